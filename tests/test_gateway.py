"""The agent gateway in process: agents written as plain `openai` code (in a folder outside
the checkout) run as `task.agent` episodes over a real gateway HTTP server and an
`EpisodeScheduler`; the engine is scripted, so what each call generates is known."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from transformers import AutoTokenizer

from asyncrl.engines.config import SamplingParams

from episode_helpers import ScriptedEngine
from gateway_helpers import (
    CALL_TEXT,
    ExactTask,
    agent_module,
    agent_scheduler,
    run_groups,
    tool_model,
)

PARAMS = SamplingParams(max_new_tokens=64)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return AutoTokenizer.from_pretrained(tool_model(tmp_path_factory.mktemp("tools") / "tiny"))


def _spelled(tokenizer: Any, ids: list[int]) -> str:
    return "".join(tokenizer.convert_ids_to_tokens(ids))


TOOL_AGENT = """
import json
from openai import AsyncOpenAI

TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]


async def run(item, base_url, api_key, out):
    client = AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages = [{"role": "user", "content": item["prompt"]}]
    seen = []
    for stream in (False, True):
        kw = dict(model="m", messages=messages, tools=TOOLS, logprobs=True)
        if not stream:
            r = await client.chat.completions.create(**kw)
            msg = r.choices[0].message
            calls = [(c.id, c.function.name, c.function.arguments) for c in msg.tool_calls]
            lps = [t.logprob for t in r.choices[0].logprobs.content]
            finish = r.choices[0].finish_reason
        else:
            calls, lps, content, finish = {}, [], "", None
            async for chunk in await client.chat.completions.create(stream=True, **kw):
                choice = chunk.choices[0]
                if choice.logprobs and choice.logprobs.content:
                    lps += [t.logprob for t in choice.logprobs.content]
                for d in choice.delta.tool_calls or []:
                    calls[d.index] = (d.id, d.function.name, d.function.arguments)
                content += choice.delta.content or ""
                finish = choice.finish_reason or finish
            calls = [calls[i] for i in sorted(calls)]
        seen.append({"calls": [c[1:] for c in calls], "logprobs": lps, "finish": finish})
        messages.append({"role": "assistant", "content": None, "tool_calls": [
            {"id": i, "type": "function", "function": {"name": n, "arguments": a}}
            for i, n, a in calls]})
        for i, n, a in calls:
            messages.append({"role": "tool", "tool_call_id": i, "content": "3"})
    with open(out, "a") as f:
        f.write(json.dumps(seen) + "\\n")
    return [0.25, 1.0]
"""


def test_agents_calls_are_batched_recorded_and_streamed_alike(
    tokenizer: Any, user_code: Path
) -> None:
    """Three agents' calls share each generate call; streaming and non-streaming replies carry
    the same tool call and the same tokens; the group's samples hold exactly what was sampled,
    the prompts loss-masked, per-call rewards on their segments."""
    reply = [*tokenizer(CALL_TEXT, add_special_tokens=False)["input_ids"], tokenizer.eos_token_id]
    engine = ScriptedEngine(reply)
    agent_module(user_code, "tool_agent", TOOL_AGENT)
    out = user_code / "seen.jsonl"
    sched, _ = agent_scheduler(
        engine,
        tokenizer,
        user_code,
        "tool_agent:run",
        params=PARAMS,
        batch_wait_s=60.0,
        kwargs={"out": str(out)},
    )
    try:
        sched.start("g", ExactTask(tokenizer).item("one plus two?"), 3, "g")
        (group,), failed = run_groups(sched, 1)
    finally:
        sched.close()
    assert failed == []
    assert engine.batches == [3, 3]  # each round of calls in one generate
    runs = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(runs) == 3
    for seen in runs:
        plain, streamed = seen
        assert plain["calls"] == streamed["calls"] == [["add", '{"a": 1, "b": 2}']]
        assert plain["finish"] == streamed["finish"] == "tool_calls"
        assert plain["logprobs"] == streamed["logprobs"] == [-0.5] * len(reply)
    # One sample per episode (each continued its first call), over the group's shared prompt.
    assert len(group.samples) == 3
    prompt = _spelled(tokenizer, group.item.prompt_ids)
    assert prompt.endswith("user:oneplustwo?assistant:")  # (this tokenizer drops spaces)
    for s in group.samples:
        assert s.loss_mask is not None and s.reward == 1.0 and s.meta == {"calls": 2}
        trained = s.response_ids[s.loss_mask == 1].tolist()
        assert trained == reply + reply  # token for token what the engine sampled
        assert (s.logprobs[s.loss_mask == 1] == -0.5).all()
        assert (s.logprobs[s.loss_mask == 0] == 0).all()
        assert (np.diff(s.versions) >= 0).all()
        observed = _spelled(tokenizer, s.response_ids[s.loss_mask == 0].tolist())
        assert "tool:3" in observed


MISBEHAVING = """
import asyncio
import openai

async def run(item, base_url, api_key):
    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    what = item["prompt"]

    async def call(content="hi"):
        return await client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": content}])

    if what == "raise":
        await call()
        raise RuntimeError("the agent's own bug")
    if what == "exit":
        raise SystemExit(3)
    if what == "hang":
        await asyncio.sleep(600)
    if what == "nocall":
        return 1.0
    if what == "many":
        for _ in range(3):
            await call()
    if what == "long":
        await call("x" * 300)
    if what == "reward":
        await call()
        return "high"
    if what == "rewards":
        await call()
        return [1.0, 2.0]
    if what == "good":
        await call()
        return 1.0
"""


def test_agents_that_misbehave_fail_their_group_by_reason(tokenizer: Any, user_code: Path) -> None:
    """Raising (a BaseException too), hanging past `timeout_s`, making no call, calling past
    `max_calls`, a prompt past the context, a reward that is none: each fails only its own
    group, with its reason; the worker's scheduler goes on (a good group finishes beside)."""
    engine = ScriptedEngine([tokenizer.eos_token_id])
    agent_module(user_code, "bad_agent", MISBEHAVING)
    sched, gateway = agent_scheduler(
        engine,
        tokenizer,
        user_code,
        "bad_agent:run",
        params=PARAMS,
        max_context=200,
        timeout_s=3.0,
        max_calls=2,
    )
    task = ExactTask(tokenizer)
    cases = {
        "raise": "agent_error",
        "exit": "agent_error",
        "hang": "agent_timeout",
        "nocall": "agent_no_calls",
        "many": "agent_over_budget",
        "long": "agent_context_too_long",
        "reward": "agent_error",
        "rewards": "agent_error",  # two rewards for one call
    }
    try:
        for what in [*cases, "good"]:
            sched.start(what, task.item("good" if what == "good" else what), 1, what)
        finished, failed = run_groups(sched, len(cases) + 1)
    finally:
        sched.close()
    assert {f.tag: f.reason for f in failed} == cases
    assert [g.tag for g in finished] == ["good"]
    assert "still running after 3.0s" in next(f.detail for f in failed if f.tag == "hang")
    assert len(gateway.sessions) == 0  # every session ended with its episode


CREDENTIALS = """
import json
import openai

def run(item, base_url, api_key, out):
    good = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    reply = good.chat.completions.create(model="m", messages=[{"role": "user", "content": "a"}])
    root = base_url.split("/s/")[0] + "/v1"
    statuses = []
    for key_url, key in ((root, "not-a-session"), (root, api_key)):
        try:
            openai.OpenAI(base_url=key_url, api_key=key, max_retries=0).models.list()
            statuses.append(200)
        except openai.APIStatusError as exc:
            statuses.append(exc.status_code)
    with open(out, "w") as f:
        json.dump({"base_url": base_url, "api_key": api_key, "root": root,
                   "statuses": statuses}, f)
    return None
"""


def test_calls_need_a_live_session_and_an_ended_one_is_refused_at_once(
    tokenizer: Any, user_code: Path
) -> None:
    """A sync agent: its base URL alone or its API key on the plain URL reach its session; an
    unknown key is refused (401); once the episode is over its credentials get 410 at once."""
    import openai

    engine = ScriptedEngine(
        [*tokenizer.encode("3", add_special_tokens=False), tokenizer.eos_token_id]
    )
    agent_module(user_code, "cred_agent", CREDENTIALS)
    out = user_code / "creds.json"
    sched, _ = agent_scheduler(
        engine, tokenizer, user_code, "cred_agent:run", params=PARAMS, kwargs={"out": str(out)}
    )
    try:
        sched.start("c", ExactTask(tokenizer).item("what?"), 1, "c")
        (group,), failed = run_groups(sched, 1)
        seen = json.loads(out.read_text())
        assert seen["statuses"] == [401, 200]
        assert failed == [] and group.samples[0].reward == 1.0  # the task scored "3"
        for url, key in ((seen["base_url"], "x"), (seen["root"], seen["api_key"])):
            client = openai.OpenAI(base_url=url, api_key=key, max_retries=0)
            with pytest.raises(openai.APIStatusError) as gone:
                client.chat.completions.create(
                    model="m", messages=[{"role": "user", "content": "b"}]
                )
            assert gone.value.status_code == 410 and "session is over" in str(gone.value)
    finally:
        sched.close()


def test_the_example_agent_runs_unchanged(tokenizer: Any) -> None:
    """examples/openai_agent/agent.py (a sync `openai` loop) runs its tool on the model's tool
    calls and calls again with the results, to its `max_turns`."""
    reply = [*tokenizer(CALL_TEXT, add_special_tokens=False)["input_ids"], tokenizer.eos_token_id]
    folder = Path(__file__).resolve().parents[1] / "examples" / "openai_agent"
    sched, _ = agent_scheduler(
        ScriptedEngine(reply),
        tokenizer,
        folder,
        "agent:solve",
        params=PARAMS,
        kwargs={"max_turns": 2},
    )
    try:
        sched.start("e", ExactTask(tokenizer).item("what is one plus two?"), 1, "e")
        (group,), failed = run_groups(sched, 1)
    finally:
        sched.close()
    assert failed == []
    (sample,) = group.samples
    assert sample.meta == {"calls": 2} and sample.reward == 0.0  # its last turn still called
    assert sample.loss_mask is not None
    assert "tool:3" in _spelled(tokenizer, sample.response_ids[sample.loss_mask == 0].tolist())


@pytest.mark.parametrize(
    ("settings", "says"),
    [
        ({"task.agent.path": "nowhere:run"}, "cannot import 'nowhere'"),
        ({"task.agent.path": "sig_agent:no_credentials"}, "cannot be called as fn(item, base_url"),
        (
            {"task.environment": {"type": "remote", "urls": ["http://x:1"]}},
            "task.agent and task.environment exclude each other",
        ),
    ],
)
def test_agent_config_errors(
    settings: dict[str, Any], says: str, user_code: Path, tmp_path: Path
) -> None:
    from asyncrl.config import load_config, write_config

    agent_module(
        user_code,
        "sig_agent",
        "def run(item, base_url, api_key): ...\ndef no_credentials(item): ...\n",
    )
    path = write_config(
        tmp_path / "c.yaml",
        {
            "task.type": "arithmetic",
            "task.agent.python_path": [str(user_code)],
            "task.agent.path": "sig_agent:run",
            "trainer.eval_every": 0,
            **settings,
        },
    )
    with pytest.raises(ValueError) as bad:
        load_config(path)
    assert says in str(bad.value)


def test_held_out_evaluation_runs_the_agent_over_a_gateway_of_its_own(
    user_code: Path, tmp_path: Path
) -> None:
    """The trainer's `Evaluator` on an agent task: every held-out item's episode is the agent's
    run, its calls served by the evaluation's own loopback gateway from the live weights, and
    the held-out reward is the mean of what the agents returned."""
    from transformers import AutoModelForCausalLM

    from asyncrl.config import load_config, write_config
    from asyncrl.evaluate import Evaluator
    from asyncrl.tasks.build import build_task

    agent_module(
        user_code,
        "eval_agent",
        """
        from openai import OpenAI

        def run(item, base_url, api_key):
            client = OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
            reply = client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": item["prompt"]}], max_tokens=3
            )
            assert reply.choices[0].message.content is not None
            return int(item["prompt"][0]) / 10  # "3+4=": 0.3
        """,
    )
    model = tool_model(tmp_path / "model")
    path = write_config(
        tmp_path / "c.yaml",
        {
            "model.path": str(model),
            "task.type": "arithmetic",
            "task.digits": 1,
            "task.eval_size": 4,
            "task.agent.python_path": [str(user_code)],
            "task.agent.path": "eval_agent:run",
            "trainer.eval_every": 1,
            "trainer.eval_size": 4,
            "trainer.eval_samples": 2,
        },
    )
    cfg = load_config(path)
    tokenizer = AutoTokenizer.from_pretrained(model)
    task = build_task(cfg.task, tokenizer)
    evaluator = Evaluator(AutoModelForCausalLM.from_pretrained(model), tokenizer, task, cfg)
    expected = np.mean([int(item.prompt[0]) / 10 for item in task.eval_items()])
    assert evaluator.reward() == pytest.approx(expected)
    assert evaluator.reward() == pytest.approx(expected)  # a fresh gateway each time
