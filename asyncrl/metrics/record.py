"""The typed lines of the run's JSONL log: one `StepRecord` per optimizer step, one `EvalRecord`
per evaluation (DESIGN §8).

Trainer rank 0 writes a `StepRecord` to `{run.dir}/metrics.jsonl` and to the `last_step` Redis
key; the Prometheus bindings, `asyncrl plot`, `asyncrl status`, the launcher's progress and the
bench tools read it back through `read_record`, never by key. The JSON keys are the field names;
a reader tolerates older lines (a missing figure reads as None) and tells eval lines apart by
their `eval_accuracy`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MISMATCH_LOG = "mismatch.jsonl"
"""Beside `metrics.jsonl`: per step, the full train/inference mismatch tables (lag × bucket,
`asyncrl.algo.mismatch.summarise`) whose summary the step line carries."""

_OMIT_NONE = {"omit_none": True}
"""Field metadata: the key is left out of the line rather than written as null."""


@dataclass(frozen=True)
class StepRecord:
    """The figures of one optimizer step, run-wide (all ranks)."""

    step: int
    """Optimizer steps taken, this one included (1 for the first)."""
    version: int | None = None
    """Policy version published after the step; None on a line that lacks it."""
    wall_seconds: float | None = None
    """Trainer wall time since the run began, across restarts; None: not recorded."""
    groups: int | None = None
    """Trajectory groups trained on, all ranks; None: not recorded."""
    tokens: int | None = None
    """Response tokens trained on (loss-masked), all ranks; None: not recorded."""
    reward_mean: float | None = None
    """Mean reward of rank 0's samples of the step; None: not recorded."""
    staleness_mean: float | None = None
    """Mean staleness (trainer version − oldest token version) of rank 0's groups; None: not
    recorded."""
    staleness_max: int | None = None
    """Largest staleness of rank 0's groups; None: not recorded."""
    episode_turns_generated: float | None = field(default=None, metadata=_OMIT_NONE)
    """Mean turns of the longest episode of rank 0's groups generated for the step (trained or
    dropped stale); None: not recorded."""
    episode_turns_trained: float | None = field(default=None, metadata=_OMIT_NONE)
    """The same over the groups the step trained; None: not recorded."""
    episode_tokens_generated: float | None = field(default=None, metadata=_OMIT_NONE)
    """Mean response tokens (observations included) of the longest episode of rank 0's groups
    generated for the step; None: not recorded."""
    episode_tokens_trained: float | None = field(default=None, metadata=_OMIT_NONE)
    """The same over the groups the step trained; None: not recorded."""
    episode_seconds_generated: float | None = field(default=None, metadata=_OMIT_NONE)
    """Mean wall seconds from a group's start to its publishing, groups generated for the step;
    None: not recorded."""
    episode_seconds_trained: float | None = field(default=None, metadata=_OMIT_NONE)
    """The same over the groups the step trained; None: not recorded."""
    length_bias_ks: float | None = field(default=None, metadata=_OMIT_NONE)
    """Length bias over the run (the trainer's last 1,000 steps since it started): the largest
    two-sample KS statistic, over turns, tokens and seconds, between rank 0's groups generated
    and trained (0: no bias; dropping the slow groups raises it); None: not recorded."""
    tokens_lag_masked_fraction: float | None = field(default=None, metadata=_OMIT_NONE)
    """Fraction of rank 0's trained tokens left out of the loss for being older than
    `algo.max_token_lag`; None: not recorded."""
    behaviour_weight_mean: float | None = None
    """Mean truncated behaviour weight over response tokens; None: not recorded."""
    behaviour_weight_capped_fraction: float | None = None
    """Fraction of behaviour weights at the cap; None: not recorded."""
    clip_fraction: float | None = None
    """Fraction of the trained response tokens whose ratio was clipped, all ranks; None: not
    recorded."""
    behaviour_logprob_abs_diff_lag0: float | None = None
    """Mean |trainer − behaviour| log-prob over tokens of the current version; None: the step
    had no such token."""
    lag0_tokens: int | None = None
    """Tokens behind `behaviour_logprob_abs_diff_lag0`; None: not recorded."""
    loss: float | None = None
    """The step's loss; None: not recorded, or not finite (JSON has no NaN)."""
    grad_norm: float | None = None
    """Gradient norm before clipping; None: not recorded, or not finite."""
    lr: float | None = None
    """Learning rate of the step; None: not recorded."""
    skipped_nonfinite: bool | None = None
    """True when the loss or gradient norm was not finite and the optimizer did not step."""
    step_seconds: float | None = None
    """Wall time of the step (train and publish); None: not recorded."""
    wait_seconds: float | None = None
    """Time spent collecting the step's groups: idle time when rollouts are the bottleneck."""
    weight_publish_blocking_seconds: float | None = None
    """Time the loop waited to hand the weights to the publisher; None: not recorded."""
    weight_sync_seconds: float | None = None
    """Duration of the last finished weight delivery; None: none had finished yet."""
    behaviour_weight_p50: float | None = field(default=None, metadata=_OMIT_NONE)
    """Median behaviour weight of rank 0's trained tokens; None (key absent): no token."""
    behaviour_weight_p90: float | None = field(default=None, metadata=_OMIT_NONE)
    """90th percentile of the behaviour weights; None (key absent): no token."""
    behaviour_weight_p99: float | None = field(default=None, metadata=_OMIT_NONE)
    """99th percentile of the behaviour weights; None (key absent): no token."""
    mfu: float | None = field(default=None, metadata=_OMIT_NONE)
    """Model FLOPs utilisation (0..1); None (key absent): trainer.peak_flops is not set."""
    tokens_per_second: float | None = field(default=None, metadata=_OMIT_NONE)
    """Trainer throughput as measured by a bench tool; the trainer leaves it out (see
    `throughput`)."""
    mismatch_logprob_abs_diff: float | None = field(default=None, metadata=_OMIT_NONE)
    """Mean |trainer − behaviour| log-prob over every trained token, at every lag (engine
    mismatch plus policy change); None (key absent): no token, or an older line."""
    mismatch_ratio_mean: float | None = field(default=None, metadata=_OMIT_NONE)
    """Mean importance ratio π_trainer / π_behaviour over the same tokens; None: as above."""
    audit_tokens: int | None = field(default=None, metadata=_OMIT_NONE)
    """Response tokens the rollout workers' audit rescored (`rollout.audit_fraction`), all
    ranks; None (key absent): none."""
    audit_logprob_abs_diff: float | None = field(default=None, metadata=_OMIT_NONE)
    """Mean |audit − behaviour| log-prob: the same weights through the trainer's forward path,
    pure engine mismatch at lag 0; None (key absent): no audited token."""
    audit_logprob_abs_diff_low_prob: float | None = field(default=None, metadata=_OMIT_NONE)
    """The same over audited tokens of behaviour probability < 0.1 (`mismatch.LOW_PROB`);
    None (key absent): none."""
    audit_logprob_abs_diff_high_prob: float | None = field(default=None, metadata=_OMIT_NONE)
    """The same over audited tokens of behaviour probability ≥ 0.1; None (key absent): none."""
    routing_tokens: int | None = field(default=None, metadata=_OMIT_NONE)
    """Mixture-of-experts models: tokens with a recorded rollout routing (prompt and response,
    `rollout.capture_routing`), all ranks; None (key absent): none."""
    routing_agreement: float | None = field(default=None, metadata=_OMIT_NONE)
    """Fraction of those tokens × MoE layers whose experts in the trainer's forward had the
    rollout's top-k set (1.0 under `algo.routing_replay`); None (key absent): no such token."""
    routing_agreement_router: float | None = field(default=None, metadata=_OMIT_NONE)
    """The same for the experts the trainer's router picked itself (equal to
    `routing_agreement` without replay); None (key absent): no such token."""
    routing_agreement_worst_layer: float | None = field(default=None, metadata=_OMIT_NONE)
    """The lowest per-layer `routing_agreement`; None (key absent): no such token."""
    breakdown_seconds: float | None = field(default=None, metadata=_OMIT_NONE)
    """Trainer wall seconds since the previous step line (`metrics.breakdown`): the interval
    the `time_*` fractions split; None (key absent): an older line."""
    time_wait: float | None = field(default=None, metadata=_OMIT_NONE)
    """Fraction of the interval spent waiting for trajectories (`breakdown.TRAINER_PHASES`
    says what each phase holds); the nine `time_*` fractions sum to 1."""
    time_collate: float | None = field(default=None, metadata=_OMIT_NONE)
    time_proximal: float | None = field(default=None, metadata=_OMIT_NONE)
    time_forward_backward: float | None = field(default=None, metadata=_OMIT_NONE)
    time_all_reduce: float | None = field(default=None, metadata=_OMIT_NONE)
    time_optimizer: float | None = field(default=None, metadata=_OMIT_NONE)
    time_publish: float | None = field(default=None, metadata=_OMIT_NONE)
    time_checkpoint: float | None = field(default=None, metadata=_OMIT_NONE)
    time_other: float | None = field(default=None, metadata=_OMIT_NONE)

    @property
    def throughput(self) -> float | None:
        """Trainer tokens/s: `tokens_per_second` if the line has it, else tokens / step_seconds;
        None when neither is known."""
        if self.tokens_per_second is not None:
            return self.tokens_per_second
        if self.tokens is not None and self.step_seconds is not None and self.step_seconds > 0:
            return self.tokens / self.step_seconds
        return None

    def to_json(self) -> dict[str, Any]:
        """The line's JSON object: every figure, None as null, but for the keys that are left
        out when unknown (the weight quantiles, mfu, tokens_per_second, the mismatch figures)."""
        return {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if getattr(self, f.name) is not None or not f.metadata.get("omit_none")
        }

    @classmethod
    def from_json(cls, value: Mapping[str, Any]) -> StepRecord:
        """A step line read back; missing or mistyped figures read as None, unknown keys are
        ignored (lines of older and newer versions alike)."""
        return cls(**_typed(cls, value))


@dataclass(frozen=True)
class EvalRecord:
    """One evaluation on held-out items."""

    step: int
    """Optimizer steps taken when the evaluation ran."""
    eval_accuracy: float
    """Mean held-out episode reward (accuracy for 0/1 rewards)."""
    wall_seconds: float | None = None
    """Trainer wall time since the run began; None: not recorded."""

    def to_json(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "wall_seconds": self.wall_seconds,
            "eval_accuracy": self.eval_accuracy,
        }

    @classmethod
    def from_json(cls, value: Mapping[str, Any]) -> EvalRecord:
        return cls(**_typed(cls, value))


@dataclass(frozen=True)
class WorkerRecord:
    """One interval of one rollout worker: a line of `{run.dir}/rollout.jsonl` (`ROLLOUT_LOG`),
    written every `metrics.breakdown_every_s` and when the worker stops."""

    worker: str
    """The worker id."""
    wall_seconds: float
    """Seconds since the worker started."""
    version: int
    """Policy version the engine held at the end of the interval."""
    tokens: int
    """Response tokens generated in the interval."""
    groups: int
    """Trajectory groups published in the interval."""
    breakdown_seconds: float
    """The interval's wall seconds, which the `time_*` fractions split
    (`breakdown.ROLLOUT_PHASES`); they sum to 1."""
    time_prefill: float
    time_decode: float
    time_generate: float
    time_env: float
    time_hold: float
    time_weight_swap: float
    time_publish: float
    time_other: float

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, value: Mapping[str, Any]) -> WorkerRecord | None:
        """A line read back; None for one that lacks a figure (cut short, or not one)."""
        typed = _typed(cls, value)
        if len(typed) != len(dataclasses.fields(cls)):
            return None
        return cls(**typed)


ROLLOUT_LOG = "rollout.jsonl"
"""Beside `metrics.jsonl`: the rollout workers' `WorkerRecord` lines (all workers, one file)."""


def read_worker_log(run_dir: Path) -> list[WorkerRecord]:
    """The `WorkerRecord`s of a run directory, in the order written; none without the file."""
    from asyncrl.metrics.jsonl import read_jsonl

    path = run_dir / ROLLOUT_LOG
    if not path.is_file():
        return []
    return [r for r in map(WorkerRecord.from_json, read_jsonl(path)) if r is not None]


Record = StepRecord | EvalRecord


def is_eval_record(value: Mapping[str, Any]) -> bool:
    """Eval lines carry `eval_accuracy`; step lines never do."""
    return "eval_accuracy" in value


def read_record(value: object) -> Record | None:
    """The typed record of one JSON object of the log (or of the `last_step` key); None for
    anything that is not one (no integer `step`, not an object)."""
    if not isinstance(value, Mapping) or not _is_number(value.get("step")):
        return None
    if is_eval_record(value):
        if not _is_number(value["eval_accuracy"]):
            return None
        return EvalRecord.from_json(value)
    return StepRecord.from_json(value)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


_KINDS: dict[str, tuple[type, ...]] = {
    "int": (int,),
    "float": (int, float),
    "bool": (bool,),
    "str": (str,),
}


def _typed(cls: type, value: Mapping[str, Any]) -> dict[str, Any]:
    """The fields of `cls` found in `value` with a value of their type; `step` (the records
    that have one) as an int."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        v = value.get(f.name)
        kind = str(f.type).split(" ")[0]
        if isinstance(v, _KINDS[kind]) and (kind == "bool" or not isinstance(v, bool)):
            out[f.name] = float(value[f.name]) if kind == "float" else v
    if "step" in {f.name for f in dataclasses.fields(cls)}:
        out["step"] = int(value["step"])
    return out
