"""`asyncrl doctor`: the diagnosis of constructed runs whose bottleneck is known — rollout-bound
(one worker, slow generation), trainer-bound (many workers, a heavy step), sync-heavy (a large
model published often), environment-bound (a slow tool) — from typed records, through the run
directory and the CLI; and the short verdict `asyncrl status` shows. A real run of the
environment-bound case is `test_doctor_e2e.py`."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from asyncrl.config import dump_yaml, load_config
from asyncrl.doctor import (
    RunFacts,
    diagnose,
    from_run_dir,
    latest_splits,
    rollout_input,
    trainer_input,
)
from asyncrl.launch.status import doctor_summary
from asyncrl.metrics.breakdown import ROLLOUT_PHASES, TRAINER_PHASES, TimeSplit
from asyncrl.metrics.record import ROLLOUT_LOG, StepRecord, WorkerRecord
from asyncrl.reasons import Bottleneck

REPO = Path(__file__).resolve().parent.parent


def _fractions(phases: tuple[str, ...], **shares: float) -> dict[str, float]:
    """Every phase of the role, `other` taking what `shares` leave."""
    out = {p: 0.0 for p in phases} | shares
    out["other"] = 1.0 - sum(v for p, v in out.items() if p != "other")
    return out


def steps(
    n: int, seconds: float = 2.0, mfu: float | None = None, **shares: float
) -> list[StepRecord]:
    fractions = _fractions(TRAINER_PHASES, **shares)
    return [
        StepRecord(
            step=i,
            mfu=mfu,
            weight_sync_seconds=0.8,
            **TimeSplit(seconds, fractions).fields(),
        )
        for i in range(1, n + 1)
    ]


def workers(n: int, intervals: int = 5, **shares: float) -> list[WorkerRecord]:
    fractions = _fractions(ROLLOUT_PHASES, **shares)
    return [
        WorkerRecord(f"w{w}", 10.0 * (i + 1), i, 100, 2, **TimeSplit(10.0, fractions).fields())
        for i in range(intervals)
        for w in range(n)
    ]


FACTS = RunFacts(
    rollout_workers=1,
    max_staleness=1,
    max_inflight_episodes=256,
    prefix_cache_tokens=0,
    max_new_tokens=512,
    micro_batch_tokens=16384,
    groups_per_step=64,
    checkpoint_every=10,
)


def _diagnose(trainer: list[StepRecord], rollout: list[WorkerRecord], facts: RunFacts = FACTS):  # type: ignore[no-untyped-def]
    split, figures = trainer_input(trainer)
    return diagnose(split, rollout_input(rollout), figures, facts)


def test_rollout_bound_one_worker_slow_generation() -> None:
    d = _diagnose(
        steps(20, wait=0.7, forward_backward=0.25, publish=0.01),
        workers(1, prefill=0.3, decode=0.6, publish=0.02),
    )
    assert d.bottleneck is Bottleneck.GENERATION
    first = d.findings[0]
    assert "waited 70%" in first.headline and "generated 90%" in first.headline
    # 30 % of the demand is met: about 3.3x the generation, 4 workers.
    assert first.changes[0].startswith("rollout.workers: 1 → 4 ")
    assert any(c.startswith("rollout.engine.prefix_cache_tokens: 0 → ") for c in first.changes)
    assert any("max_new_tokens (now 512)" in c for c in first.changes)
    assert Bottleneck.WEIGHT_SYNC not in {f.kind for f in d.findings}


def test_trainer_bound_many_workers_heavy_step() -> None:
    facts = RunFacts(**{**FACTS.__dict__, "rollout_workers": 8})
    d = _diagnose(
        steps(20, wait=0.03, forward_backward=0.8, optimizer=0.1, publish=0.02),
        workers(8, decode=0.3, hold=0.65),
        facts,
    )
    assert d.bottleneck is Bottleneck.TRAINER
    first = d.findings[0]
    assert "65%" in first.headline
    assert first.changes[0].startswith("rollout.workers: 8 → 3 ")
    assert any(c.startswith("trainer.micro_batch_tokens: 16384 → 32768") for c in first.changes)


def test_sync_heavy_large_model_frequent_publishes() -> None:
    d = _diagnose(
        steps(20, wait=0.25, forward_backward=0.4, publish=0.3),
        workers(2, decode=0.55, weight_swap=0.25, hold=0.1),
    )
    assert d.bottleneck is Bottleneck.WEIGHT_SYNC
    first = d.findings[0]
    assert "30%" in first.headline and "25%" in first.headline and "0.80 s" in first.headline
    assert first.changes[0].startswith("model.lora")
    # Without the trainer's figures (`asyncrl status` has only the splits) it says no duration.
    alone = diagnose(d.trainer, d.rollout)
    assert alone.bottleneck is Bottleneck.WEIGHT_SYNC and " s)" not in alone.findings[0].headline
    assert any(c.startswith("trainer.groups_per_step: 64 → 128") for c in first.changes)


def test_environment_bound_slow_tool() -> None:
    d = _diagnose(
        steps(20, wait=0.8, forward_backward=0.15),
        workers(1, env=0.75, decode=0.1, prefill=0.05),
    )
    assert d.bottleneck is Bottleneck.ENVIRONMENT
    first = d.findings[0]
    assert "75%" in first.headline
    assert first.changes[0] == (
        "rollout.max_inflight_episodes: 256 → 512 (more episodes in flight keep the engine busy "
        "while tools run)"
    )


def test_tools_waiting_with_the_whole_admission_window_in_flight_name_the_window() -> None:
    # (η + 1) × G × n = 2 × 64 × 4 = 512 episodes admitted; two workers may run 256 each.
    full = RunFacts(**{**FACTS.__dict__, "rollout_workers": 2, "samples_per_prompt": 4})
    split = (steps(20, wait=0.7, forward_backward=0.25), workers(2, env=0.8, decode=0.05))
    d = _diagnose(*split, full)
    assert d.bottleneck is Bottleneck.STALENESS
    first = d.findings[0]
    assert "= 512; the workers may run 512" in first.headline
    assert first.changes[0].startswith("algo.max_staleness: 1 → 3 ")
    assert not any("max_inflight_episodes" in c or "rollout.workers" in c for c in first.changes)
    # With slots for fewer episodes than admission allows, the slots are what to raise.
    short = RunFacts(**{**full.__dict__, "max_inflight_episodes": 128})
    d = _diagnose(*split, short)
    assert d.bottleneck is Bottleneck.ENVIRONMENT
    assert d.findings[0].changes[0].startswith("rollout.max_inflight_episodes: 128 → 256 ")
    # Sync admits one step's groups: going async is the wider window.
    sync = RunFacts(**{**full.__dict__, "mode": "sync", "max_inflight_episodes": 256})
    assert _diagnose(*split, sync).findings[0].changes[0].startswith("run.mode: sync → async")


def test_a_balanced_run_has_no_bottleneck_and_mfu_is_placed_in_its_range() -> None:
    d = _diagnose(
        steps(20, wait=0.1, forward_backward=0.8, publish=0.01, mfu=0.3),
        workers(2, decode=0.85, hold=0.1),
    )
    assert d.findings == []
    assert d.bottleneck is None
    assert any(n.startswith("MFU 30.0%: below the 40%–50%") for n in d.notes)


def test_staleness_bound_holds_both_sides() -> None:
    d = _diagnose(steps(20, wait=0.5, forward_backward=0.45), workers(2, decode=0.3, hold=0.6))
    assert d.bottleneck is Bottleneck.STALENESS
    assert d.findings[0].changes == [
        "algo.max_staleness: 1 → 3 (prompts may then start on older weights)"
    ]
    sync = RunFacts(mode="sync")
    assert (
        _diagnose(
            steps(20, wait=0.5, forward_backward=0.45), workers(2, decode=0.3, hold=0.6), sync
        )
        .findings[0]
        .changes[0]
        .startswith("run.mode: sync → async")
    )


def test_warm_up_steps_and_a_worker_start_are_left_out() -> None:
    early = steps(2, wait=0.99)
    late = [StepRecord(**{**s.to_json(), "step": s.step + 2}) for s in steps(10, wait=0.1)]
    split, figures = trainer_input([*early, *late])
    assert split is not None and split.fractions["wait"] == pytest.approx(0.1)
    assert figures.steps == (3, 12)
    idle = TimeSplit(10.0, _fractions(ROLLOUT_PHASES, hold=1.0)).fields()
    start = [WorkerRecord("w0", 10.0, 0, 40, 0, **idle)]  # tokens, but no group yet
    end = [WorkerRecord("w0", 90.0, 0, 0, 0, **idle)]
    split_r = rollout_input([*start, *workers(1, decode=0.5), *end])
    assert split_r is not None and split_r.fractions["hold"] == 0.0
    assert split_r.seconds == 50.0


def _write_run(run_dir: Path, trainer: list[StepRecord], rollout: list[WorkerRecord]) -> None:
    run_dir.mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text(
        "".join(json.dumps(s.to_json()) + "\n" for s in trainer)
        + json.dumps({"step": 20, "eval_accuracy": 0.5})
        + "\n"
    )
    (run_dir / ROLLOUT_LOG).write_text("".join(json.dumps(r.to_json()) + "\n" for r in rollout))
    cfg = load_config(str(REPO / "configs" / "quickstart.yaml"), [f"run.dir={run_dir}"])
    (run_dir / "config.yaml").write_text(dump_yaml(cfg))


def test_doctor_reads_a_run_directory_and_its_config(tmp_path: Path) -> None:
    run = tmp_path / "run"
    _write_run(run, steps(20, wait=0.7, forward_backward=0.25), workers(1, decode=0.9))
    diagnosis, title = from_run_dir(run)
    assert diagnosis.bottleneck is Bottleneck.GENERATION
    # The quickstart's settings: one worker, 4 new tokens.
    assert diagnosis.findings[0].changes[0].startswith("rollout.workers: 1 → 4 ")
    assert "steps 3–20, 1 rollout worker(s)" in title
    out = subprocess.run(
        [sys.executable, "-m", "asyncrl", "doctor", str(run)],
        capture_output=True,
        text=True,
        check=False,
        cwd=REPO,
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[3].startswith("Bottleneck: generation — the trainer waited 70%")
    assert len(lines) <= 25 and max(map(len, lines[1:])) <= 100  # one screen


def test_doctor_of_a_directory_without_records_exits_1(tmp_path: Path) -> None:
    from asyncrl.doctor import main

    assert main(tmp_path) == 1


def test_status_shows_the_verdict_of_the_latest_figures() -> None:
    last = steps(1, wait=0.8, forward_backward=0.15)[0].to_json()
    beats = [
        {"id": "w0", "time": _fractions(ROLLOUT_PHASES, env=0.9)},
        {"id": "w1", "time": _fractions(ROLLOUT_PHASES, env=0.6, decode=0.3)},
        {"id": "w2", "time": {"env": "junk"}},  # a heartbeat of another version: not read
    ]
    trainer, rollout = latest_splits(last, beats)
    assert trainer is not None and trainer.fractions["wait"] == pytest.approx(0.8)
    assert rollout is not None and rollout.fractions["env"] == pytest.approx(0.75)
    summary = doctor_summary({"last_step": last, "workers": {"rollout": beats, "trainer": []}})
    assert summary is not None and summary["bottleneck"] == "environment"
    assert "waited 80%" in summary["headline"]
    assert doctor_summary({"last_step": None, "workers": None}) is None
