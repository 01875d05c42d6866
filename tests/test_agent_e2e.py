"""An agent people already have, trained unchanged, through real processes: a plain `openai`
loop with one tool, written outside the checkout and knowing nothing of asyncrl but its
`base_url` and `api_key`, runs as `task.agent` in a rollout worker; a trainer trains on what its
calls generated. Mid-run a worker is SIGKILLed while its agents are mid-session and the trainer
is SIGKILLed after a step: the run still ends with every step's groups trained once, nothing
lost (the killed worker's prompts are delivered again), and every trained sample's tokens are
exactly what the agents received, with their log-probs and versions."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import numpy as np
import pytest
import redis
from transformers import AutoTokenizer

from asyncrl.launch.redis_server import RedisServer
from asyncrl.launch.status import collect_status
from asyncrl.protocol import decode_group
from asyncrl.runstate import Counter, Keys

from gateway_helpers import agent_run_settings, tool_model
from role_procs import (
    QUICK_TAKEOVER,
    Role,
    pending_prompts,
    step_lines,
    stop_all,
    wait_until,
    write_role_config,
)

STEPS, G, N, CALLS = 3, 2, 2, 2

AGENT = """
import asyncio
import json
import os

from openai import AsyncOpenAI

TOOLS = [{"type": "function", "function": {
    "name": "add", "description": "add two integers",
    "parameters": {"type": "object", "properties": {
        "a": {"type": "integer"}, "b": {"type": "integer"}}}}}]


def add(a, b):
    return a + b


async def run(item, base_url, api_key, log_dir):
    client = AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages = [{"role": "user", "content": item["prompt"]}]
    received = []
    for _ in range(2):
        reply = await client.chat.completions.create(
            model="mine", messages=messages, tools=TOOLS, logprobs=True, max_tokens=8)
        choice = reply.choices[0]
        received.append([[t.token, t.logprob] for t in choice.logprobs.content])
        with open(os.path.join(log_dir, "calls.log"), "a") as f:
            f.write(f"{os.getpid()}\\n")
        messages.append(choice.message.model_dump(exclude_none=True))
        await asyncio.sleep(0.3)  # the tool's own time
        for call in choice.message.tool_calls or []:
            result = add(**json.loads(call.function.arguments))
            messages.append({"role": "tool", "tool_call_id": call.id, "content": str(result)})
        if not choice.message.tool_calls:
            messages.append({"role": "user", "content": "again?"})
    with open(os.path.join(log_dir, "episodes.jsonl"), "a") as f:
        f.write(json.dumps(received) + "\\n")
"""


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_unchanged_openai_agent_trains_through_kills(
    redis_server: RedisServer, redis_client: redis.Redis, tmp_path: Path, user_code: Path
) -> None:
    (user_code / "my_agent.py").write_text(textwrap.dedent(AGENT))
    model = tool_model(tmp_path / "model")
    keys = Keys("agent-e2e")
    redis_client.xgroup_create(keys.trajectories, "probe", id="0", mkstream=True)
    run_dir = tmp_path / "run"
    config = write_role_config(
        tmp_path,
        redis_server.url,
        model,
        keys.run_id,
        {
            **QUICK_TAKEOVER,
            **agent_run_settings(STEPS, G, N),
            "task.agent.python_path": [str(user_code)],
            "task.agent.path": "my_agent:run",
            "task.agent.kwargs": {"log_dir": str(user_code)},
            "task.agent.timeout_s": 120,
            "trainer.checkpoint_every": 1,
        },
    )
    logs = tmp_path / "logs"
    trainer = Role("trainer", config, logs / "trainer-1.log")
    w0 = Role("rollout", config, logs / "w0.log", "--worker-id", "w0")
    roles = [trainer, w0]
    calls = user_code / "calls.log"
    try:
        # A worker killed while its agents are mid-session leaves their prompts pending.
        wait_until(calls.exists, 240, "a first agent call", roles)
        held = pending_prompts(redis_client, keys, "w0")
        w0.kill()
        assert held, "w0 held no prompt when killed"
        w1 = Role("rollout", config, logs / "w1.log", "--worker-id", "w1")
        roles = [trainer, w1]
        wait_until(
            lambda: not held & pending_prompts(redis_client, keys, "w0"),
            120,
            "the killed worker's prompts taken over",
            roles,
        )
        wait_until(lambda: len(step_lines(run_dir)) >= 1, 240, "trainer step 1", roles)
        trainer.kill()
        second = Role("trainer", config, logs / "trainer-2.log")
        roles = [second, w1]
        assert second.wait(300) == 0, second.tail()
        assert w1.stop() == 0, w1.tail()
    finally:
        stop_all(roles)

    status = collect_status(redis_client, keys, run_dir)
    counters, streams = status["counters"], status["streams"]
    assert status["balanced"] is True, status
    assert counters[Counter.GROUPS_TRAINED] == STEPS * G  # each step's groups acked once
    assert counters[Counter.GROUPS_DEAD_LETTERED] == 0
    assert streams["trajectories"]["pending"] == 0

    last_version = int(redis_client.get(keys.version) or 0)  # a restart publishes one more
    tokenizer = AutoTokenizer.from_pretrained(model)
    episodes = [
        json.loads(line) for line in (user_code / "episodes.jsonl").read_text().splitlines()
    ]
    groups = [decode_group(f[b"data"]) for _, f in redis_client.xrange(keys.trajectories)]
    assert len(groups) >= STEPS * G
    for g in groups:
        assert len(g.samples) >= N
        for s in g.samples:
            mask = s.loss_mask
            assert mask is not None and (mask[: len(mask) // 4] == 0).any()
            trained = s.response_ids[mask == 1].tolist()
            got = list(
                zip(
                    [tokenizer.decode([t]) for t in trained],
                    s.logprobs[mask == 1].tolist(),
                    strict=True,
                )
            )
            assert any(_made_of(got, e) for e in episodes), got
            assert (s.logprobs[mask == 0] == 0).all() and (s.logprobs[mask == 1] < 0).all()
            assert (np.diff(s.versions) >= 0).all() and s.versions.max() <= last_version
    assert sum(int(s.meta["calls"]) for g in groups for s in g.samples) == CALLS * N * len(groups)


def _made_of(got: list[tuple[str, float]], episode: list[list[list[object]]]) -> bool:
    """Whether `got` is what consecutive calls of `episode` received, token for token."""
    calls = [[(str(t), float(lp)) for t, lp in call] for call in episode]  # type: ignore[arg-type]
    return any(
        got == [x for call in calls[i:j] for x in call]
        for i in range(len(calls))
        for j in range(i + 1, len(calls) + 1)
    )
