"""The agentic task and the episode scheduler: hand-worked episodes (tokens, masks, versions
across a weight swap, rewards), many episodes in flight behind a slow tool, and failures."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from asyncrl.environments.base import Environment, StepResult
from asyncrl.evaluate import held_out_reward
from asyncrl.items import PromptItem
from asyncrl.protocol import TrajectoryGroup, decode_group, encode_group
from asyncrl.rollout.scheduler import EpisodeScheduler
from asyncrl.tasks.agentic import AgenticTask, ArithmeticToolEnvironment, LogNormalLatency
from asyncrl.tasks.base import ArithmeticTask
from asyncrl.tasks.build import build_task
from asyncrl.tasks.config import AgenticTaskConfig, ArithmeticTaskConfig
from asyncrl.tiny_model import BOS_ID, EOS_ID, build_tokenizer

from episode_helpers import (
    EQ,
    PARAMS,
    PLUS,
    ScriptedEngine,
    answering_one,
    digit,
    run_until_done,
    run_until_failed,
)


def test_agentic_items_split_and_first_turn_score() -> None:
    tok = build_tokenizer()
    task = AgenticTask(AgenticTaskConfig(turns=3, eval_size=10, train_size=20), tok)
    train, held_out = task.train_items(0, 0), task.eval_items()
    assert (len(train), len(held_out)) == (20, 10)
    item = train[0]
    questions = item.prompt_id.split(";")
    assert len(questions) == 3
    assert item.prompt == questions[0] + "="
    assert item.prompt_ids == tok(item.prompt)["input_ids"]
    for q, scripted in zip(questions, item.answer.split(";"), strict=True):
        a, b = map(int, q.split("+"))
        assert scripted == f"{a}+{b}={a + b}"
    seen = {q for it in train for q in it.prompt_id.split(";")}
    assert not seen & {q for it in held_out for q in it.prompt_id.split(";")}
    first = sum(map(int, questions[0].split("+")))
    assert task.score(item, str(first)) == 1.0
    assert task.score(item, str(first + 1)) == 0.0
    # Registered in the factory by config `type`.
    built = build_task(AgenticTaskConfig(turns=2, eval_size=5, train_size=5), tok)
    assert isinstance(built, AgenticTask)
    with pytest.raises(ValueError, match=r"task\.eval_size"):
        AgenticTask(AgenticTaskConfig(turns=8, eval_size=1100), tok)


def test_hard_episodes_wait_longer_on_their_tool() -> None:
    """`hard_tool_factor`: an episode whose first sum has more digits than its operands (a
    carry out, "56+78=134") is hard, and its tool calls take that many times the median."""
    cfg = AgenticTaskConfig(
        turns=2, eval_size=10, train_size=50, tool_latency_median_s=0.001, tool_latency_sigma=0.0
    )
    task = AgenticTask(cfg.model_copy(update={"hard_tool_factor": 5.0}), build_tokenizer())
    items = list(task.train_items(0, 0))
    hard = [it for it in items if task.is_hard(it)]
    easy = [it for it in items if not task.is_hard(it)]
    assert hard and easy
    for it in hard:
        assert int(it.answer.split(";")[0].partition("=")[2]) >= 100
    for it in easy:
        assert int(it.answer.split(";")[0].partition("=")[2]) < 100

    def waited(item: PromptItem) -> float:
        env = task.environment(item, "e")

        async def one_turn() -> float:
            await env.reset(item)
            await env.step("0")
            return env.waited_s

        return asyncio.run(one_turn())

    assert waited(hard[0]) == pytest.approx(0.005)
    assert waited(easy[0]) == pytest.approx(0.001)


def test_lognormal_latency_median_spread_and_seed() -> None:
    fixed = LogNormalLatency(0.25, 0.0, np.random.default_rng(0))
    assert [fixed.draw() for _ in range(3)] == [0.25, 0.25, 0.25]
    assert LogNormalLatency(0.0, 1.0, np.random.default_rng(0)).draw() == 0.0
    draws = [LogNormalLatency(0.2, 1.0, np.random.default_rng(7)).draw() for _ in range(2)]
    assert draws[0] == draws[1]  # seeded
    many = np.array(
        [LogNormalLatency(0.2, 1.0, np.random.default_rng(i)).draw() for i in range(2000)]
    )
    assert 0.17 < np.median(many) < 0.23
    assert many.max() / many.min() > 100  # tens of times apart, and more


def test_episode_tokens_masks_versions_and_reward_hand_worked() -> None:
    tok = build_tokenizer()
    task = AgenticTask(
        AgenticTaskConfig(turns=2, eval_size=1, train_size=1, tool_latency_median_s=0.0), tok
    )
    item = PromptItem("12+34;56+78", "12+34=", tok("12+34=")["input_ids"], "12+34=46;56+78=134")
    engine = ScriptedEngine([digit(4), digit(6), EOS_ID])  # "46": right, then wrong
    # Episodes start at their environment's `reset`: the batch wait lets both join turn 1.
    sched: EpisodeScheduler[str] = EpisodeScheduler(engine, task, tok, PARAMS, batch_wait_s=5)
    engine.version = 3
    sched.start("g", item, 2, "entry-1")
    assert sched.inflight == 2
    assert sched.advance(5.0) == ([], [])  # turn 1 generated; both episodes at the tool
    engine.version = 4  # a weight swap between the turns
    (group,) = run_until_done(sched, 1)
    sched.close()
    assert sched.inflight == 0
    # Turn 1 of both episodes in one generate call; turn 2 as they came back from the tool.
    assert engine.batches[0] == 2 and sum(engine.batches) == 4
    obs = [BOS_ID, digit(5), digit(6), PLUS, digit(7), digit(8), EQ]
    answer = [digit(4), digit(6), EOS_ID]
    for s in group.samples:
        assert s.response_ids.tolist() == answer + obs + answer
        assert s.loss_mask is not None
        assert s.loss_mask.tolist() == [1] * 3 + [0] * 7 + [1] * 3
        assert s.versions.tolist() == [3] * 3 + [3] * 7 + [4] * 3
        assert s.logprobs.tolist() == [-0.5] * 3 + [0.0] * 7 + [-0.5] * 3
        assert s.reward == 0.5
        assert s.meta == {"turns": 2}
    # The wire accepts it: versions non-decreasing, logprobs ≤ 0, mask 0/1.
    wire = TrajectoryGroup(
        run="r",
        group_id="entry-1",
        prompt_id=item.prompt_id,
        release_version=3,
        worker="w",
        created_at=group.created_at,
        finished_at=time.time(),
        prompt_ids=np.asarray(item.prompt_ids, np.int32),
        samples=group.samples,
    )
    back = decode_group(encode_group(wire), current_version=4)
    assert back.samples[0].loss_mask.tolist() == group.samples[0].loss_mask.tolist()  # type: ignore[union-attr]


def test_single_turn_task_is_one_generate_and_inline_score() -> None:
    tok = build_tokenizer()
    task = ArithmeticTask(ArithmeticTaskConfig(eval_size=1, train_size=2), tok)
    items = list(task.train_items(0, 0))
    engine = ScriptedEngine([digit(4), digit(6), EOS_ID])
    sched: EpisodeScheduler[int] = EpisodeScheduler(engine, task, tok, PARAMS)
    for i, item in enumerate(items):
        sched.start(i, item, 3, f"e{i}")
    finished, failed = sched.advance(0.0)
    sched.close()
    assert engine.batches == [6] and not failed and sched.inflight == 0
    assert [f.tag for f in finished] == [0, 1]
    for f in finished:
        want = 1.0 if f.item.answer == "46" else 0.0
        for s in f.samples:
            assert s.loss_mask is None and s.meta == {}
            assert s.response_ids.tolist() == [digit(4), digit(6), EOS_ID]
            assert s.reward == want


def test_failed_generation_fails_only_its_group() -> None:
    tok = build_tokenizer()
    task = AgenticTask(
        AgenticTaskConfig(turns=2, eval_size=1, train_size=4, tool_latency_median_s=0.0), tok
    )
    items = list(task.train_items(0, 0))[:2]
    engine = ScriptedEngine([digit(1), EOS_ID])
    sched: EpisodeScheduler[str] = EpisodeScheduler(engine, task, tok, PARAMS, batch_wait_s=5)
    sched.start("a", items[0], 2, "a")
    sched.start("b", items[1], 2, "b")
    engine.fail_at = {3}  # the second episode of group b
    finished, failed = sched.advance(5.0)
    assert finished == [] and [(f.tag, f.reason) for f in failed] == [("b", "engine_timeout")]
    assert sched.inflight == 2
    (group,) = run_until_done(sched, 1)
    sched.close()
    assert group.tag == "a" and len(group.samples) == 2 and sched.inflight == 0


class _BrokenTool:
    async def reset(self, item: PromptItem) -> None:
        return None

    async def step(self, response: str) -> StepResult:
        raise ConnectionError("tool down")

    async def close(self) -> None:
        pass


class _BrokenToolTask(ArithmeticTask):
    def environment(self, item: PromptItem, episode_id: str) -> _BrokenTool:
        return _BrokenTool()


def test_failing_tool_fails_its_group_not_the_scheduler() -> None:
    tok = build_tokenizer()
    task = _BrokenToolTask(ArithmeticTaskConfig(eval_size=1, train_size=1), tok)
    sched = answering_one(task, tok)
    sched.start("x", task.train_items(0, 0)[0], 2, "x")
    failed = run_until_failed(sched, 10)
    sched.close()
    assert [(f.tag, f.reason) for f in failed] == [("x", "env_error")]
    assert "tool down" in failed[0].detail and sched.inflight == 0


def test_an_engine_crash_fails_the_calls_groups_not_the_scheduler(random_model: Path) -> None:
    # A token id past the vocabulary makes the builtin engine's embedding raise IndexError, not
    # an EngineError: the groups of that call fail (the worker dead-letters them), and the
    # scheduler goes on with the next call.
    from asyncrl.engines.config import TorchEngineConfig
    from asyncrl.rollout.backends import build_engine

    tok = build_tokenizer()
    task = ArithmeticTask(ArithmeticTaskConfig(eval_size=1, train_size=2), tok)
    good, other = list(task.train_items(0, 0))[:2]
    bad = PromptItem("bad", "", [BOS_ID, 999], "")
    engine = build_engine(TorchEngineConfig(), model_path=str(random_model))
    sched: EpisodeScheduler[str] = EpisodeScheduler(engine, task, tok, PARAMS)
    sched.start("bad", bad, 2, "bad")
    sched.start("with-bad", good, 2, "with-bad")  # shares the call: its cause is unknown
    finished, failed = sched.advance(0.0)
    assert finished == [] and sched.inflight == 0
    assert [(f.tag, f.reason) for f in failed] == [
        ("bad", "engine_error"),
        ("with-bad", "engine_error"),
    ]
    assert "IndexError" in failed[0].detail
    sched.start("next", other, 2, "next")
    (group,) = run_until_done(sched, 1)
    sched.close()
    assert group.tag == "next" and len(group.samples) == 2


class _BrokenScoreTask(ArithmeticTask):
    def score(self, item: PromptItem, response_text: str) -> float:
        raise KeyError("no verifier for this answer")


class _BrokenEnvironmentTask(AgenticTask):
    def environment(self, item: PromptItem, episode_id: str) -> Environment:
        raise ValueError(f"cannot parse the answer {item.answer!r}")


def test_failing_task_code_fails_its_group_not_the_scheduler() -> None:
    tok = build_tokenizer()
    scorer = _BrokenScoreTask(ArithmeticTaskConfig(eval_size=1, train_size=1), tok)
    sched = answering_one(scorer, tok)
    sched.start("s", scorer.train_items(0, 0)[0], 2, "s")
    finished, failed = sched.advance(0.0)
    assert finished == [] and [(f.tag, f.reason) for f in failed] == [("s", "task_error")]
    assert "no verifier" in failed[0].detail and sched.inflight == 0

    env_task = _BrokenEnvironmentTask(AgenticTaskConfig(turns=2, eval_size=1, train_size=1), tok)
    sched = answering_one(env_task, tok)
    sched.start("e", env_task.train_items(0, 0)[0], 2, "e")
    # Still in flight until handed back: a worker advances only while episodes are in flight.
    assert sched.inflight == 2
    finished, failed = sched.advance(0.0)
    assert finished == [] and [(f.tag, f.reason) for f in failed] == [("e", "task_error")]
    assert "cannot parse" in failed[0].detail and sched.inflight == 0
    sched.close()


def test_scheduler_keeps_episodes_in_flight_behind_a_slow_tool(
    random_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from transformers import AutoTokenizer

    from asyncrl.engines.config import TorchEngineConfig
    from asyncrl.rollout.backends import build_engine

    groups, n, turns, latency = 12, 2, 3, 0.4
    tok = AutoTokenizer.from_pretrained(random_model)
    task = AgenticTask(
        AgenticTaskConfig(
            turns=turns,
            eval_size=1,
            train_size=groups,
            tool_latency_median_s=latency,
            tool_latency_sigma=0.0,
        ),
        tok,
    )
    # Tool calls outstanding at once (they all run on the scheduler's one event loop).
    waiting = most = 0
    step = ArithmeticToolEnvironment.step

    async def counted(self: ArithmeticToolEnvironment, response: str) -> StepResult:
        nonlocal waiting, most
        waiting += 1
        most = max(most, waiting)
        try:
            return await step(self, response)
        finally:
            waiting -= 1

    monkeypatch.setattr(ArithmeticToolEnvironment, "step", counted)
    engine = build_engine(TorchEngineConfig(), model_path=str(random_model))
    sched: EpisodeScheduler[int] = EpisodeScheduler(engine, task, tok, PARAMS)
    t0 = time.monotonic()
    for i, item in enumerate(list(task.train_items(0, 0))[:groups]):
        sched.start(i, item, n, f"e{i}")
    assert sched.inflight == groups * n
    done = run_until_done(sched, groups)
    elapsed = time.monotonic() - t0
    sched.close()
    # Every episode waited turns × latency on its tool, and the episodes waited side by side:
    # at least half of them at their tools at once (not one, as run one after another).
    assert elapsed >= turns * latency, elapsed
    assert most >= groups * n // 2, most
    for g in done:
        for s in g.samples:
            assert s.meta == {"turns": turns}
            assert s.loss_mask is not None and (s.loss_mask == 0).sum() > 0
            assert (np.diff(s.versions) >= 0).all()
            assert (s.logprobs[s.loss_mask == 0] == 0).all()


def test_close_cancels_episodes_waiting_on_their_tools(
    random_model: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A worker stopping with episodes at their tools leaves no task pending and no loop thread."""
    import gc
    import threading

    from transformers import AutoTokenizer

    from asyncrl.engines.config import TorchEngineConfig
    from asyncrl.rollout.backends import build_engine

    tok = AutoTokenizer.from_pretrained(random_model)
    task = AgenticTask(
        AgenticTaskConfig(turns=3, eval_size=1, train_size=4, tool_latency_median_s=60.0),
        tok,
    )
    engine = build_engine(TorchEngineConfig(), model_path=str(random_model))
    sched: EpisodeScheduler[int] = EpisodeScheduler(engine, task, tok, PARAMS, batch_wait_s=5)
    for i, item in enumerate(list(task.train_items(0, 0))[:4]):
        sched.start(i, item, 2, f"e{i}")
    sched.advance(5.0)  # first turns generated; the 8 episodes now wait a minute on their tools
    deadline = time.monotonic() + 10
    while len(sched._envs.steps) < 8 and time.monotonic() < deadline:
        time.sleep(0.01)  # the loop thread starts the steps
    steps = list(sched._envs.steps)
    assert len(steps) == 8 and not any(t.done() for t in steps)
    t0 = time.monotonic()
    sched.close()
    assert time.monotonic() - t0 < 30  # cancelled, not waited out (the tools take a minute)
    assert all(t.cancelled() for t in steps)  # not left pending on a stopped loop
    del steps
    gc.collect()  # a pending task collected here is what asyncio reports as destroyed
    assert not [t for t in threading.enumerate() if t.name == "env-loop"]
    assert "destroyed" not in caplog.text


def test_generate_calls_report_prompt_tokens_from_the_prefix_cache(random_model: Path) -> None:
    """The worker's `asyncrl_rollout_prompt_tokens_total{source}` comes from these reports."""
    from transformers import AutoTokenizer

    from asyncrl.engines.config import TorchEngineConfig
    from asyncrl.rollout.backends import build_engine
    from asyncrl.rollout.turns import GenerateCall

    tok = AutoTokenizer.from_pretrained(random_model)
    task = AgenticTask(
        AgenticTaskConfig(turns=3, eval_size=1, train_size=4, tool_latency_median_s=0.0), tok
    )
    engine = build_engine(
        TorchEngineConfig(prefix_cache_tokens=10_000), model_path=str(random_model)
    )
    calls: list[GenerateCall] = []
    sched: EpisodeScheduler[int] = EpisodeScheduler(
        engine, task, tok, PARAMS, on_generate=calls.append
    )
    for i, item in enumerate(list(task.train_items(0, 0))[:4]):
        sched.start(i, item, 2, f"e{i}")
    run_until_done(sched, 4)
    sched.close()
    assert calls[0].cached_tokens == 0  # first turns: nothing cached yet
    assert sum(c.cached_tokens for c in calls) > 0  # later turns: their earlier turns' keys
    assert all(0 <= c.cached_tokens < c.prompt_tokens for c in calls)


class BrokenTask(AgenticTask):
    """The tool of the item whose first question is 99+99 fails its episodes."""

    def environment(self, item: PromptItem, episode_id: str) -> Environment:
        if item.prompt_id.startswith("99+99"):
            return _BrokenTool()
        return super().environment(item, episode_id)


def test_held_out_reward_scores_every_turn_and_leaves_out_failed_items() -> None:
    """The trainer's eval and bench_async's final reward: whole episodes, not first turns."""
    tok = build_tokenizer()
    cfg = AgenticTaskConfig(turns=2, eval_size=1, train_size=1, tool_latency_median_s=0.0)
    engine = ScriptedEngine([digit(4), digit(6), EOS_ID])  # always "46"

    def item(*questions: str) -> PromptItem:
        sums = [sum(map(int, q.split("+"))) for q in questions]
        prompt = f"{questions[0]}="
        answer = ";".join(f"{q}={s}" for q, s in zip(questions, sums, strict=True))
        return PromptItem(";".join(questions), prompt, tok(prompt)["input_ids"], answer)

    items = [item("12+34", "56+78"), item("10+36", "20+26")]  # 46 then 134: 1/2; 46, 46: 1
    reward = held_out_reward(engine, AgenticTask(cfg, tok), tok, items, PARAMS, samples=3)
    assert reward == pytest.approx(0.75)  # scoring first turns only would give 1.0
    assert sum(engine.batches) == 2 * 2 * 3  # two turns of 2 items × 3 episodes
    broken = [*items, item("99+99", "10+36")]
    assert held_out_reward(engine, BrokenTask(cfg, tok), tok, broken, PARAMS) == 0.75
    assert held_out_reward(engine, BrokenTask(cfg, tok), tok, broken[2:], PARAMS) is None
    # A one-turn task: one generate, each response scored.
    arith = ArithmeticTask(ArithmeticTaskConfig(eval_size=2, train_size=2), tok)
    single = [
        PromptItem(q, f"{q}=", tok(f"{q}=")["input_ids"], a)
        for q, a in (("12+34", "46"), ("12+35", "47"))
    ]
    assert held_out_reward(engine, arith, tok, single, PARAMS, samples=2) == 0.5


def test_groups_with_a_token_older_than_the_bound_are_given_up(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`drop_older_than` gives up exactly the groups holding a token older than the bound (one
    whose episode is at its tool mid-episode, not one whose first turn is still to come), hands
    each back once as `stale`, closes its environments and frees its episodes."""
    tok = build_tokenizer()
    task = AgenticTask(
        AgenticTaskConfig(turns=2, eval_size=1, train_size=4, tool_latency_median_s=0.3), tok
    )
    closed = 0

    async def close(self: ArithmeticToolEnvironment) -> None:
        nonlocal closed
        closed += 1

    monkeypatch.setattr(ArithmeticToolEnvironment, "close", close)
    items = list(task.train_items(0, 0))[:3]
    engine = ScriptedEngine([digit(1), EOS_ID])
    sched: EpisodeScheduler[str] = EpisodeScheduler(engine, task, tok, PARAMS)
    sched.start("old", items[0], 2, "old")
    assert sched.advance(5.0) == ([], [])  # a turn 1 at version 0, gone to the tool
    engine.version = 4
    sched.start("new", items[1], 2, "new")
    assert sched.advance(5.0) == ([], [])  # turns 1 at version 4 or later
    sched.start("unstarted", items[2], 2, "unstarted")  # no token yet: nothing to judge
    sched.drop_older_than(3)
    sched.drop_older_than(3)  # asking again gives nothing up twice
    done, failed = [], []
    deadline = time.monotonic() + 30
    while len(done) < 2:
        assert time.monotonic() < deadline, "episodes did not finish"
        finished, lost = sched.advance(0.05)
        done += finished
        failed += lost
    sched.close()
    assert [(f.tag, f.reason) for f in failed] == [("old", "stale")]
    assert sorted(g.tag for g in done) == ["new", "unstarted"] and sched.inflight == 0
    assert closed == 6  # every episode's environment, the given-up group's too


CLOSED: list[str] = []
"""The episodes whose `_OneFailsFast` environment was closed."""


class _OneFailsFast:
    """Episode 0's tool fails at once; every other episode's tool takes a minute."""

    def __init__(self, episode_id: str) -> None:
        self.episode_id = episode_id

    async def reset(self, item: PromptItem) -> None:
        return None

    async def step(self, response: str) -> StepResult:
        if self.episode_id.endswith("/0"):
            raise ConnectionError("tool down")
        await asyncio.sleep(60)
        return StepResult(None, done=True, reward=1.0)

    async def close(self) -> None:
        CLOSED.append(self.episode_id)


class _OneFailsFastTask(ArithmeticTask):
    def environment(self, item: PromptItem, episode_id: str) -> _OneFailsFast:
        return _OneFailsFast(episode_id)


def test_a_failing_episode_cancels_the_rest_of_its_group_at_once() -> None:
    """One group, one result: the first failure fails the group, and its other episodes, a
    minute from their end at their tools, are cancelled there and then, their environments
    closed, while the scheduler is still running (not when it closes)."""
    tok = build_tokenizer()
    task = _OneFailsFastTask(ArithmeticTaskConfig(eval_size=1, train_size=1), tok)
    CLOSED.clear()
    sched = answering_one(task, tok)
    sched.start("g", task.train_items(0, 0)[0], 3, "g")
    failed = run_until_failed(sched, 10)
    assert [(f.tag, f.reason) for f in failed] == [("g", "env_error")]
    deadline = time.monotonic() + 10
    while len(CLOSED) < 3 and time.monotonic() < deadline:
        sched.advance(0.05)
    assert sorted(CLOSED) == ["g/0", "g/1", "g/2"]
    assert sched.inflight == 0
    sched.close()


class _DoneAtOnce:
    async def reset(self, item: PromptItem) -> None:
        return None

    async def step(self, response: str) -> StepResult:
        return StepResult(None, done=True)  # no reward: the task scores the turn

    async def close(self) -> None:
        pass


SCORED_ON: list[str] = []
"""The threads `_ScoredWhereTask.score` ran on."""


class _ScoredWhereTask(ArithmeticTask):
    def environment(self, item: PromptItem, episode_id: str) -> _DoneAtOnce:
        return _DoneAtOnce()

    def score(self, item: PromptItem, response_text: str) -> float:
        SCORED_ON.append(threading.current_thread().name)
        return super().score(item, response_text)


def test_a_multi_turn_episodes_score_runs_on_a_thread_of_its_own() -> None:
    """Neither the loop (a reward may block it) nor the generating thread (the engine; an
    episode's end would wait a generate call for it) runs a multi-turn episode's score."""
    tok = build_tokenizer()
    task = _ScoredWhereTask(ArithmeticTaskConfig(eval_size=1, train_size=1), tok)
    SCORED_ON.clear()
    sched = answering_one(task, tok)
    sched.start("g", task.train_items(0, 0)[0], 2, "g")
    (group,) = run_until_done(sched, 1)
    sched.close()
    assert len(group.samples) == 2 and len(SCORED_ON) == 2
    assert all(name.startswith("score") for name in SCORED_ON)
