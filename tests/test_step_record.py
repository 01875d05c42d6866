"""`StepRecord` / `EvalRecord`: the JSON keys of metrics.jsonl and `last_step` are the field
names, and reading tolerates older lines, newer keys and eval lines."""

from __future__ import annotations

import dataclasses
import json

from asyncrl.metrics.record import EvalRecord, StepRecord, is_eval_record, read_record

# A step line as the trainer wrote it before StepRecord existed (no quantiles: no token had a
# behaviour weight; no mfu: trainer.peak_flops unset).
LINE = {
    "step": 3,
    "version": 4,
    "wall_seconds": 12.5,
    "groups": 8,
    "tokens": 1200,
    "reward_mean": 0.5,
    "staleness_mean": 0.75,
    "staleness_max": 2,
    "behaviour_weight_mean": 0.98,
    "behaviour_weight_capped_fraction": 0.01,
    "clip_fraction": 0.1,
    "behaviour_logprob_abs_diff_lag0": None,
    "lag0_tokens": 0,
    "loss": 0.25,
    "grad_norm": 1.5,
    "lr": 1e-05,
    "skipped_nonfinite": False,
    "step_seconds": 0.7,
    "wait_seconds": 0.2,
    "weight_publish_blocking_seconds": 0.002,
    "weight_sync_seconds": None,
}


def test_a_step_line_round_trips_with_its_keys_unchanged() -> None:
    record = read_record(json.loads(json.dumps(LINE)))
    assert isinstance(record, StepRecord)
    assert record.to_json() == LINE
    assert list(record.to_json()) == list(LINE)  # in the order the trainer always wrote them


def test_optional_figures_are_written_only_when_known() -> None:
    full = dataclasses.replace(
        StepRecord.from_json(LINE),
        behaviour_weight_p50=1.0,
        behaviour_weight_p90=1.2,
        behaviour_weight_p99=1.9,
        mfu=0.3,
    )
    keys = list(full.to_json())
    assert keys[-5:] == [
        "weight_sync_seconds",
        "behaviour_weight_p50",
        "behaviour_weight_p90",
        "behaviour_weight_p99",
        "mfu",
    ]


def test_older_and_newer_lines_read_with_unknown_figures_as_none() -> None:
    old = read_record({"step": 2, "version": 2, "reward_mean": 0.2, "from_the_future": 1})
    assert old == StepRecord(step=2, version=2, reward_mean=0.2)
    # Mistyped figures read as unknown; integers where floats are meant read as floats.
    odd = StepRecord.from_json({"step": 1, "loss": "nan", "wall_seconds": 3, "groups": 2.5})
    assert (odd.loss, odd.wall_seconds, odd.groups) == (None, 3.0, None)


def test_eval_lines_and_non_records() -> None:
    line = {"step": 4, "wall_seconds": 9.0, "eval_accuracy": 0.625}
    assert is_eval_record(line)
    record = read_record(line)
    assert record == EvalRecord(step=4, eval_accuracy=0.625, wall_seconds=9.0)
    assert isinstance(record, EvalRecord) and record.to_json() == line
    assert read_record({"version": 3}) is None
    assert read_record(["step", 1]) is None
    assert read_record({"step": True}) is None
    assert read_record({"step": 1, "eval_accuracy": None}) is None
