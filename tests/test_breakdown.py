"""The time breakdown (`asyncrl.metrics.breakdown`): exclusive phases on a fake clock with
hand-worked values, fractions that sum to 1, the records and Prometheus series it feeds; then the
phases the real trainer step and the real torch engine charge, and a profiler trace of a real
trainer step read back as Chrome/Perfetto trace JSON."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from asyncrl.algo.config import AlgoConfig
from asyncrl.engines.sampling import SamplingParams
from asyncrl.metrics import breakdown as bd
from asyncrl.metrics.breakdown import (
    ROLLOUT_PHASES,
    TRAINER_PHASES,
    Breakdown,
    TimeSplit,
    mean_split,
    phase,
    split_of,
)
from asyncrl.metrics.record import StepRecord, WorkerRecord, read_record
from asyncrl.metrics.roles import RoleMetrics
from asyncrl.profiling import ProfileConfig, StepProfiler
from asyncrl.tiny_model import new_tiny_model, save_random_tiny_model
from asyncrl.trainer.batch import group_rows

import trainer_step_proc as proc
from engine_helpers import PROMPTS, make_engine, perturbed


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Iterator[Clock]:
    c = Clock()
    monkeypatch.setattr(bd, "perf_counter", c)
    yield c
    bd.deactivate()


def test_nested_phases_are_exclusive_and_sum_to_the_wall_time(clock: Clock) -> None:
    b = Breakdown(TRAINER_PHASES)
    clock.now += 1.0  # other
    with b.phase("forward_backward"):
        clock.now += 2.0
        with b.phase("collate"):
            clock.now += 0.5
        clock.now += 1.0
        with b.phase("no_such_phase"):  # not the trainer's: stays in forward_backward
            clock.now += 0.25
    with pytest.raises(RuntimeError), b.phase("publish"):
        clock.now += 0.25
        raise RuntimeError  # time lost to a failure is still time spent
    split = b.take()
    assert split.seconds == pytest.approx(5.0)
    assert split.fractions["forward_backward"] == pytest.approx(3.25 / 5)
    assert split.fractions["collate"] == pytest.approx(0.5 / 5)
    assert split.fractions["publish"] == pytest.approx(0.25 / 5)
    assert split.fractions["other"] == pytest.approx(1.0 / 5)
    assert set(split.fractions) == set(TRAINER_PHASES)
    assert sum(split.fractions.values()) == pytest.approx(1.0, abs=1e-12)
    # A new interval begins: only what came after the take.
    clock.now += 2.0
    again = b.take()
    assert again.seconds == pytest.approx(2.0) and again.fractions["other"] == 1.0


def test_a_take_inside_a_phase_charges_it_and_keeps_it_open(clock: Clock) -> None:
    b = Breakdown(ROLLOUT_PHASES)
    with b.phase("env"):
        clock.now += 3.0
        first = b.take()
        clock.now += 1.0
    clock.now += 1.0
    second = b.take()
    assert first.fractions["env"] == 1.0
    assert second.fractions["env"] == pytest.approx(0.5)
    assert second.fractions["other"] == pytest.approx(0.5)


def test_module_phase_charges_the_thread_active_breakdown_only(clock: Clock) -> None:
    b = Breakdown(ROLLOUT_PHASES).activate()
    elsewhere: list[object] = []

    def other_thread() -> None:
        with phase("decode"):  # no breakdown on this thread: a no-op
            clock.now += 10.0
        elsewhere.append(getattr(bd._local, "breakdown", None))

    with phase("decode"):
        clock.now += 1.0
    t = threading.Thread(target=other_thread)
    t.start()
    t.join()
    split = b.take()
    assert elsewhere == [None]
    assert split.fractions["decode"] == pytest.approx(1.0 / 11.0)
    bd.deactivate()
    with phase("decode"):  # off: nothing is charged, nothing raises
        clock.now += 1.0
    assert b.take().fractions["other"] == 1.0


def test_an_empty_interval_reads_as_all_other() -> None:
    split = TimeSplit.of(dict.fromkeys(TRAINER_PHASES, 0.0))
    assert split.seconds == 0.0 and split.fractions["other"] == 1.0
    assert sum(split.fractions.values()) == 1.0


def test_mean_split_weights_intervals_by_their_seconds() -> None:
    a = TimeSplit(1.0, {"env": 1.0, "other": 0.0})
    b = TimeSplit(3.0, {"env": 0.0, "other": 1.0})
    m = mean_split([a, b])
    assert m is not None and m.seconds == 4.0
    assert m.fractions == {"env": 0.25, "other": 0.75}
    assert mean_split([]) is None


def test_step_and_worker_records_carry_the_split_through_json(clock: Clock) -> None:
    b = Breakdown(TRAINER_PHASES)
    with b.phase("wait"):
        clock.now += 3.0
    clock.now += 1.0
    record = StepRecord(step=2, **b.take().fields())
    back = read_record(json.loads(json.dumps(record.to_json())))
    assert isinstance(back, StepRecord)
    split = split_of(back, TRAINER_PHASES)
    assert split is not None and split.seconds == 4.0 and split.fractions["wait"] == 0.75
    assert sum(split.fractions.values()) == pytest.approx(1.0)
    # A line of an older version has no breakdown: no split, and its JSON has no such key.
    assert split_of(StepRecord(step=1), TRAINER_PHASES) is None
    assert "time_wait" not in StepRecord(step=1).to_json()

    r = Breakdown(ROLLOUT_PHASES)
    with r.phase("decode"):
        clock.now += 1.0
    worker = WorkerRecord("w1", 5.0, 3, 40, 2, **r.take().fields())
    line = json.loads(json.dumps(worker.to_json()))
    assert WorkerRecord.from_json(line) == worker
    assert WorkerRecord.from_json({**line, "time_env": None}) is None  # cut short: not a record
    assert "time_wait" not in {f"time_{p}" for p in ROLLOUT_PHASES}  # the roles' own phases


def test_record_fields_name_every_phase_of_their_role() -> None:
    step_fields = {f for f in StepRecord.__dataclass_fields__ if f.startswith("time_")}
    worker_fields = {f for f in WorkerRecord.__dataclass_fields__ if f.startswith("time_")}
    assert step_fields == {f"time_{p}" for p in TRAINER_PHASES}
    assert worker_fields == {f"time_{p}" for p in ROLLOUT_PHASES}


def test_prometheus_gets_seconds_and_fractions() -> None:
    m = RoleMetrics("rollout", "bd-test")
    m.observe_split(TimeSplit(10.0, {p: 0.0 for p in ROLLOUT_PHASES} | {"env": 0.6, "decode": 0.4}))
    assert m.breakdown_seconds["env"]._value.get() == pytest.approx(6.0)
    assert m.breakdown_seconds["decode"]._value.get() == pytest.approx(4.0)
    assert m.time_fraction["env"]._value.get() == pytest.approx(0.6)


def test_counters_advance_as_each_phase_ends(clock: Clock) -> None:
    """With counters, a phase's seconds are exported when it ends (left, or paused by a nested
    one), not at the next `take`: a scrape between reports sees the time so far, and over the
    intervals the counters hold exactly the splits' seconds."""
    m = RoleMetrics("rollout", "bd-live")
    seconds = m.breakdown_seconds
    b = Breakdown(ROLLOUT_PHASES, seconds)
    clock.now += 1.0  # other, until the next phase begins
    with b.phase("env"):
        assert seconds["other"]._value.get() == pytest.approx(1.0)
        clock.now += 2.0
        with b.phase("decode"):  # pauses env: its 2 s so far are counted
            assert seconds["env"]._value.get() == pytest.approx(2.0)
            clock.now += 0.5
        assert seconds["decode"]._value.get() == pytest.approx(0.5)
        clock.now += 1.0
    assert seconds["env"]._value.get() == pytest.approx(3.0)
    with b.phase("hold"):
        clock.now += 4.0
        first = b.take()  # cuts the open phase: its time so far counted, once
        assert seconds["hold"]._value.get() == pytest.approx(4.0)
        clock.now += 1.0
    second = b.take()
    for name in ROLLOUT_PHASES:
        split_seconds = sum(s.fractions[name] * s.seconds for s in (first, second))
        assert seconds[name]._value.get() == pytest.approx(split_seconds), name
    assert sum(seconds[p]._value.get() for p in ROLLOUT_PHASES) == pytest.approx(9.5)


def _train_rows() -> list[object]:
    return group_rows(proc.make_groups(), AlgoConfig(), proc.SAMPLING.max_new_tokens)


def test_a_real_trainer_step_charges_its_phases() -> None:
    torch.manual_seed(0)
    model = new_tiny_model(seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    rows = _train_rows()
    b = Breakdown(TRAINER_PHASES).activate()
    try:
        proc.step(model, optimizer, rows, AlgoConfig(), micro_batch_tokens=64)  # type: ignore[arg-type]
        split = b.take()
    finally:
        bd.deactivate()
    for name in ("collate", "forward_backward", "proximal", "optimizer"):
        assert split.fractions[name] > 0, (name, split.fractions)
    assert split.fractions["forward_backward"] > split.fractions["collate"]
    assert sum(split.fractions.values()) == pytest.approx(1.0)


def test_the_torch_engine_charges_prefill_decode_and_an_in_flight_swap(tmp_path: Path) -> None:
    model_dir = save_random_tiny_model(tmp_path / "tiny", seed=0)
    engine = make_engine(model_dir)
    staged = perturbed(engine.model, seed=1)

    def stage_at_step_2(step: int) -> None:
        if step == 2:
            engine.stage_weights(staged, 1)

    engine.before_step = stage_at_step_2
    b = Breakdown(ROLLOUT_PHASES).activate()
    try:
        gens = engine.generate(PROMPTS, SamplingParams(max_new_tokens=6, stop_token_ids=[]))
        split = b.take()
    finally:
        bd.deactivate()
    assert engine.version == 1 and int(gens[0].versions[-1]) == 1  # the swap did happen
    for name in ("prefill", "decode", "weight_swap"):
        assert split.fractions[name] > 0, (name, split.fractions)
    assert sum(split.fractions.values()) == pytest.approx(1.0)


def test_a_profiled_trainer_step_is_a_chrome_trace(tmp_path: Path) -> None:
    model = new_tiny_model(seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    rows = _train_rows()
    profiler = StepProfiler(
        ProfileConfig(role="trainer", steps=[2]), "trainer", "trainer-0", tmp_path
    )
    off = StepProfiler(ProfileConfig(), "trainer", "trainer-0", tmp_path)
    for n in (1, 2):
        with profiler.step(n), off.step(n):
            proc.step(model, optimizer, rows, AlgoConfig())  # type: ignore[arg-type]
    traces = sorted((tmp_path / "profile").iterdir())
    assert [p.name for p in traces] == ["trainer-trainer-0-step2.json"]  # step 1 not traced
    trace = json.loads(traces[0].read_text())
    events = trace["traceEvents"]
    # Trace Event Format: complete events ("X") carry a name, a timestamp and a duration.
    complete = [e for e in events if e.get("ph") == "X"]
    assert complete and all({"name", "ts", "dur", "pid", "tid"} <= e.keys() for e in complete)
    names = {e["name"] for e in complete}
    assert "trainer-trainer-0 step 2" in names
    assert any(n.startswith("aten::") for n in names)  # the step's operators are in it
