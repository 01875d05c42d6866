"""The OpenAI Agents SDK agent of examples/agents_sdk, unchanged, as a command agent
(`task.agent.type: command`: a process per episode, the SDK's default Responses model on the
episode's `OPENAI_BASE_URL`), through a real rollout worker and trainer. One agent process is
SIGKILLed mid-episode, its calls made: its group is dead-lettered by reason with the exit, the
run still trains every step's groups once, the counters balance, every trained sample carries
the behaviour log-probs and versions of what the calls generated, and no agent process is left
running."""

from __future__ import annotations

import os
import signal
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import redis

from asyncrl.launch.redis_server import RedisServer
from asyncrl.launch.status import collect_status
from asyncrl.protocol import decode_group
from asyncrl.runstate import Counter, Keys

from gateway_helpers import agent_run_settings, dies, tool_model
from role_procs import Role, dead_letters, stop_all, wait_until, write_role_config

STEPS, G, N = 2, 2, 2
EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "agents_sdk"

AGENT = f"""
import asyncio, json, os, sys, time
sys.path.insert(0, {str(EXAMPLE)!r})
from sdk_agent import solve

log = os.environ["AGENT_LOG"]
with open(os.path.join(log, "pids.log"), "a") as f:
    f.write(f"{{os.getpid()}}\\n")
item = json.loads(os.environ["ASYNCRL_ITEM"])
url, key = os.environ["OPENAI_BASE_URL"], os.environ["OPENAI_API_KEY"]
reward = asyncio.run(solve(item, url, key, max_turns=2))
try:
    fd = os.open(os.path.join(log, "victim.lock"), os.O_CREAT | os.O_EXCL | os.O_WRONLY)
except FileExistsError:
    print(json.dumps(reward))
else:  # the first to get here waits, its calls made, for the test's SIGKILL
    with open(os.path.join(log, "victim.tmp"), "w") as f:
        f.write(str(os.getpid()))
    os.rename(os.path.join(log, "victim.tmp"), os.path.join(log, "victim.pid"))
    time.sleep(600)
"""


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_agents_sdk_command_agent_trains_through_a_kill(
    redis_server: RedisServer, redis_client: redis.Redis, tmp_path: Path, user_code: Path
) -> None:
    pytest.importorskip("agents")
    script = user_code / "sdk_command.py"
    script.write_text(textwrap.dedent(AGENT))
    model = tool_model(tmp_path / "model")
    keys = Keys("command-e2e")
    redis_client.xgroup_create(keys.trajectories, "probe", id="0", mkstream=True)
    run_dir = tmp_path / "run"
    config = write_role_config(
        tmp_path,
        redis_server.url,
        model,
        keys.run_id,
        {
            **agent_run_settings(STEPS, G, N),
            "task.agent.type": "command",
            "task.agent.argv": [sys.executable, str(script)],
            "task.agent.env": {"AGENT_LOG": str(user_code)},
            "task.agent.timeout_s": 120,
        },
    )
    logs = tmp_path / "logs"
    trainer = Role("trainer", config, logs / "trainer.log")
    worker = Role("rollout", config, logs / "w0.log", "--worker-id", "w0")
    roles = [trainer, worker]
    victim = user_code / "victim.pid"
    try:
        wait_until(victim.exists, 240, "an agent mid-episode", roles)
        os.kill(int(victim.read_text()), signal.SIGKILL)
        assert trainer.wait(300) == 0, trainer.tail()
        assert worker.stop() == 0, worker.tail()
    finally:
        stop_all(roles)

    status = collect_status(redis_client, keys, run_dir)
    counters = status["counters"]
    assert status["balanced"] is True, status
    assert counters[Counter.GROUPS_TRAINED] == STEPS * G  # each step's groups acked once
    (letter,) = dead_letters(redis_server.url, keys.run_id)
    assert letter[0] == "agent_error" and "killed by SIGKILL" in letter[1], letter
    assert status["streams"]["trajectories"]["pending"] == 0

    last_version = int(redis_client.get(keys.version) or 0)
    groups = [decode_group(f[b"data"]) for _, f in redis_client.xrange(keys.trajectories)]
    assert len(groups) >= STEPS * G
    for g in groups:
        assert len(g.samples) == N
        for s in g.samples:
            mask = s.loss_mask
            assert mask is not None and mask.any() and s.meta["calls"] >= 1
            assert (s.logprobs[mask == 1] < 0).all() and (s.logprobs[mask == 0] == 0).all()
            assert (np.diff(s.versions) >= 0).all() and s.versions.max() <= last_version
    pids = [int(p) for p in (user_code / "pids.log").read_text().split()]
    assert len(pids) >= STEPS * G * N + 1
    assert all(dies(p) for p in pids)  # no agent outlived its episode or its worker
