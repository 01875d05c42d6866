"""`asyncrl doctor RUN_DIR`: the run's time breakdown read back as advice — which role limits the
run, by how much, and the config change that addresses it, citing the figures used.

`diagnose` is a pure function of the two roles' time splits (`asyncrl.metrics.breakdown`), a few
trainer figures and the run's settings; `from_records` builds its input from the records of a
run directory (`metrics.jsonl`, `rollout.jsonl`, `config.yaml`). The thresholds are the rules of
thumb of distributed RL (docs/bottlenecks.md): generation that keeps the trainer waiting, weight
sync over 5 % of the time, all-reduce over 10 %, and MFU against the usual ranges.
"""

from __future__ import annotations

import math
import textwrap
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from asyncrl.metrics.breakdown import (
    ROLLOUT_PHASES,
    TRAINER_PHASES,
    TimeSplit,
    mean_split,
    split_of,
)
from asyncrl.metrics.record import (
    ROLLOUT_LOG,
    StepRecord,
    WorkerRecord,
    read_record,
    read_worker_log,
)
from asyncrl.reasons import Bottleneck

if TYPE_CHECKING:
    from asyncrl.config import Config

STARVED = 0.2
"""The trainer waiting this share of its time for trajectories: the rollout side limits."""
IDLE = 0.2
"""Rollout workers holding (no prompt, or prompts waiting for weights) this share."""
SYNC = 0.05
"""Publishing (trainer) or swapping (rollout) weights past this share."""
ALL_REDUCE = 0.10
CHECKPOINT = 0.10
MFU_ASYNC_TRAINER = (0.40, 0.50)
"""Typical MFU of an asynchronous RL trainer (synchronous dense FSDP: 35–45 %)."""
_WARMUP_STEPS = 2
_WIDTH = 100


@dataclass(frozen=True)
class RunFacts:
    """The settings a suggested change starts from (None: not known, e.g. no config.yaml)."""

    mode: str = "async"
    rollout_workers: int | None = None
    max_staleness: int | None = None
    max_inflight_episodes: int | None = None
    """The effective value: the setting, or a batch's worth."""
    samples_per_prompt: int | None = None
    """`rollout.n`: the episodes of a group."""
    prefix_cache_tokens: int | None = None
    """None: the engine keeps no prefix cache of asyncrl's (SGLang)."""
    max_new_tokens: int | None = None
    micro_batch_tokens: int | None = None
    groups_per_step: int | None = None
    checkpoint_every: int | None = None
    lora: bool = False

    @classmethod
    def of(cls, cfg: Config) -> RunFacts:
        engine, rollout, trainer = cfg.rollout.engine, cfg.rollout, cfg.trainer
        return cls(
            mode=cfg.run.mode,
            rollout_workers=rollout.workers,
            max_staleness=cfg.algo.max_staleness,
            max_inflight_episodes=rollout.max_inflight_episodes
            or rollout.prompts_per_batch * rollout.n,
            samples_per_prompt=rollout.n,
            prefix_cache_tokens=getattr(engine, "prefix_cache_tokens", None),
            max_new_tokens=rollout.sampling.max_new_tokens,
            micro_batch_tokens=trainer.micro_batch_tokens,
            groups_per_step=trainer.groups_per_step,
            checkpoint_every=trainer.checkpoint_every,
            lora=cfg.model.lora is not None,
        )


@dataclass(frozen=True)
class TrainerFigures:
    """Trainer figures beside its time split, over the same steps."""

    steps: tuple[int, int] | None = None
    """First and last step read."""
    mfu: float | None = None
    """Mean MFU; None: trainer.peak_flops not set."""
    weight_sync_seconds: float | None = None
    """Mean duration of a weight delivery."""


@dataclass(frozen=True)
class Finding:
    kind: Bottleneck
    severity: float
    """The figure over its threshold: the finding with the largest is the bottleneck."""
    headline: str
    changes: list[str]


@dataclass(frozen=True)
class Diagnosis:
    trainer: TimeSplit | None
    rollout: TimeSplit | None
    findings: list[Finding]
    """Worst first; empty: nothing passes a threshold."""
    notes: list[str] = field(default_factory=list)
    """What the reader should also know (MFU against its range, missing records)."""

    @property
    def bottleneck(self) -> Bottleneck | None:
        return self.findings[0].kind if self.findings else None

    def render(self, title: str) -> str:
        """One screen of plain words."""
        lines = [title]
        for role, split in (("trainer", self.trainer), ("rollout", self.rollout)):
            lines.append(f"  {role:<8} {describe(split)}")
        if not self.findings:
            lines.append("No bottleneck past the thresholds (docs/bottlenecks.md).")
        for i, f in enumerate(self.findings):
            lines.append(f"{'Bottleneck' if i == 0 else 'Also'}: {f.kind.value} — {f.headline}")
            lines += [f"  - {c}" for c in f.changes]
        lines += self.notes
        wrapped = [textwrap.fill(line, _WIDTH, subsequent_indent="    ") for line in lines[1:]]
        return "\n".join([title, *wrapped])


def describe(split: TimeSplit | None, least: float = 0.01) -> str:
    """`wait 62% · forward_backward 30% · ...`: the phases of at least `least`, largest first."""
    if split is None:
        return "no time breakdown recorded"
    parts = sorted(split.fractions.items(), key=lambda kv: -kv[1])
    shown = [f"{p} {f:.0%}" for p, f in parts if f >= least]
    return f"{' · '.join(shown)}  (over {split.seconds:.0f} s)"


def _share(split: TimeSplit | None, *phases: str) -> float:
    return 0.0 if split is None else sum(split.fractions.get(p, 0.0) for p in phases)


def _now_then(key: str, now: int | None, then: int | None, why: str, verb: str = "raise") -> str:
    """`key: now → then (why)`, or `raise key (why)` when either is not known."""
    if now is None or then is None:
        return f"{verb} {key} ({why})"
    return f"{key}: {now} → {then} ({why})"


def diagnose(
    trainer: TimeSplit | None,
    rollout: TimeSplit | None,
    figures: TrainerFigures | None = None,
    facts: RunFacts | None = None,
) -> Diagnosis:
    """The findings the two roles' splits support, worst first (see the module)."""
    figures, facts = figures or TrainerFigures(), facts or RunFacts()
    findings = [
        f
        for f in (
            _rollout_side(trainer, rollout, facts),
            _trainer_side(trainer, rollout, facts),
            _weight_sync(trainer, rollout, figures, facts),
            _over(trainer, "all_reduce", ALL_REDUCE, Bottleneck.ALL_REDUCE, facts),
            _over(trainer, "checkpoint", CHECKPOINT, Bottleneck.CHECKPOINT, facts),
        )
        if f is not None
    ]
    findings.sort(key=lambda f: -f.severity)
    notes = []
    if figures.mfu is not None:
        lo, hi = MFU_ASYNC_TRAINER
        where = "below" if figures.mfu < lo else "above" if figures.mfu > hi else "within"
        notes.append(
            f"MFU {figures.mfu:.1%}: {where} the {lo:.0%}–{hi:.0%} of an asynchronous RL "
            "trainer (synchronous dense FSDP: 35–45 %)."
        )
    if trainer is None or rollout is None:
        missing = "trainer (metrics.jsonl)" if trainer is None else f"rollout ({ROLLOUT_LOG})"
        notes.append(f"No time breakdown of the {missing}: only the other role was read.")
    return Diagnosis(trainer, rollout, findings, notes)


def _rollout_side(
    trainer: TimeSplit | None, rollout: TimeSplit | None, facts: RunFacts
) -> Finding | None:
    wait = _share(trainer, "wait")
    if trainer is None or wait < STARVED:
        return None
    generating = _share(rollout, "prefill", "decode", "generate")
    env, hold = _share(rollout, "env"), _share(rollout, "hold")
    waited = f"the trainer waited {wait:.0%} of its time for trajectories"
    if hold >= IDLE and hold >= max(generating, env):
        return Finding(
            Bottleneck.STALENESS,
            wait / STARVED,
            f"{waited}, and the rollout workers held prompts or waited for weights {hold:.0%} "
            "of theirs: the staleness bound keeps both waiting.",
            _wider_window(facts, "prompts may then start on older weights"),
        )
    workers = facts.rollout_workers
    more = None if workers is None else math.ceil(workers / max(1.0 - wait, 0.05))
    fed = f"the trainer is fed {1 - wait:.0%} of what it trains"
    faster_tool = (
        "a faster environment or tool (or a lower tool timeout): each step of it is on the "
        "episode's path"
    )
    inflight = facts.max_inflight_episodes
    window = _window_episodes(facts)
    can_run = None if inflight is None or workers is None else inflight * workers
    if env >= generating and window is not None and can_run is not None and can_run >= window:
        # Admission keeps (η + 1) × G groups released ahead of the steps, so episodes finish at
        # most at window ÷ episode time (Little's law): more slots or workers change neither.
        return Finding(
            Bottleneck.STALENESS,
            wait / STARVED,
            f"{waited}, while the rollout workers waited on environments, tools or rewards "
            f"{env:.0%} of their time with all the episodes the staleness bound admits in flight "
            f"((η + 1) × groups_per_step × n = {window}; the workers may run {can_run}): "
            "episodes finish at that window over their duration, whatever the slots.",
            [
                *_wider_window(facts, "more episodes in flight, their first tokens older"),
                faster_tool,
            ],
        )
    if env >= generating:
        return Finding(
            Bottleneck.ENVIRONMENT,
            wait / STARVED,
            f"{waited}, while the rollout workers waited on environments, tools or rewards "
            f"{env:.0%} of their time (generating {generating:.0%}).",
            [
                _now_then(
                    "rollout.max_inflight_episodes",
                    inflight,
                    None if inflight is None else 2 * inflight,
                    "more episodes in flight keep the engine busy while tools run",
                ),
                _now_then("rollout.workers", workers, more, fed),
                faster_tool,
            ],
        )
    changes = [_now_then("rollout.workers", workers, more, fed)]
    prefill = _share(rollout, "prefill")
    if generating and prefill / generating >= 0.25 and facts.prefix_cache_tokens == 0:
        changes.append(
            f"rollout.engine.prefix_cache_tokens: 0 → 200000 (prefill is {prefill / generating:.0%}"
            " of generation; later turns then prefill only what is new)"
        )
    if generating and _share(rollout, "decode") / generating >= 0.6:
        changes.append(
            _now_then(
                f"rollout.sampling.max_new_tokens (now {facts.max_new_tokens})",
                None,
                None,
                "decode dominates: the longest response sets each batch's time; lower it, or "
                "rollout.max_context_tokens, if responses run to the limit",
                verb="lower",
            )
        )
    return Finding(
        Bottleneck.GENERATION,
        wait / STARVED,
        f"{waited}, while the rollout workers generated {generating:.0%} of theirs.",
        changes,
    )


def _window_episodes(facts: RunFacts) -> int | None:
    """Episodes admission lets run at once: (η + 1) × groups_per_step × n (η = 0 in sync)."""
    eta = 0 if facts.mode == "sync" else facts.max_staleness
    if eta is None or facts.groups_per_step is None or facts.samples_per_prompt is None:
        return None
    return (eta + 1) * facts.groups_per_step * facts.samples_per_prompt


def _wider_window(facts: RunFacts, why: str) -> list[str]:
    """The change that lets more work start ahead of the trainer."""
    if facts.mode == "sync":
        return ["run.mode: sync → async (generation overlaps training)"]
    eta = facts.max_staleness
    return [_now_then("algo.max_staleness", eta, None if eta is None else eta + 2, why)]


def _trainer_side(
    trainer: TimeSplit | None, rollout: TimeSplit | None, facts: RunFacts
) -> Finding | None:
    hold = _share(rollout, "hold")
    if trainer is None or rollout is None or _share(trainer, "wait") >= STARVED or hold < IDLE:
        return None
    busy = 1.0 - _share(trainer, "wait", "other")
    workers = facts.rollout_workers
    fewer = None if workers is None else max(1, math.ceil(workers * (1.0 - hold)))
    changes = []
    if workers is not None and fewer is not None and fewer < workers:
        changes.append(
            f"rollout.workers: {workers} → {fewer} (they idle {hold:.0%}: the same throughput "
            "with fewer, and their hardware for the trainer)"
        )
    fb = _share(trainer, "forward_backward")
    if fb >= 0.5:
        mb = facts.micro_batch_tokens
        changes.append(
            _now_then(
                "trainer.micro_batch_tokens",
                mb,
                None if mb is None else 2 * mb,
                f"forward/backward is {fb:.0%} of the step; larger micro-batches use the device "
                "better, memory allowing",
            )
        )
    changes.append("more trainer capacity: trainer.ranks (data parallel) or a faster device")
    if not facts.lora:
        changes.append("model.lora: a cheaper step and optimizer state, if the task allows it")
    return Finding(
        Bottleneck.TRAINER,
        hold / IDLE,
        f"the rollout workers waited for prompts or weights {hold:.0%} of their time while the "
        f"trainer was busy {busy:.0%} of its own (waiting {_share(trainer, 'wait'):.0%}).",
        changes,
    )


def _weight_sync(
    trainer: TimeSplit | None, rollout: TimeSplit | None, figures: TrainerFigures, facts: RunFacts
) -> Finding | None:
    publish, swap = _share(trainer, "publish"), _share(rollout, "weight_swap")
    worst = max(publish, swap)
    if worst < SYNC:
        return None
    seconds = figures.weight_sync_seconds
    took = "" if seconds is None else f" (a delivery took {seconds:.2f} s)"
    changes = [] if facts.lora else ["model.lora: only the adapter is published and swapped"]
    groups = facts.groups_per_step
    changes += [
        "a sparse delta sync of the weights, where the weights transport offers one",
        _now_then(
            "trainer.groups_per_step",
            groups,
            None if groups is None else 2 * groups,
            "half as many publishes per trained group",
        ),
    ]
    return Finding(
        Bottleneck.WEIGHT_SYNC,
        worst / SYNC,
        f"publishing weights took {publish:.0%} of the trainer's time and swapping them "
        f"{swap:.0%} of the rollout workers' (over the {SYNC:.0%} rule of thumb)"
        f"{took}.",
        changes,
    )


def _over(
    trainer: TimeSplit | None, phase: str, limit: float, kind: Bottleneck, facts: RunFacts
) -> Finding | None:
    share = _share(trainer, phase)
    if share < limit:
        return None
    if kind is Bottleneck.CHECKPOINT:
        every = facts.checkpoint_every
        change = _now_then(
            "trainer.checkpoint_every", every, None if every is None else 2 * every, "fewer writes"
        )
    else:
        groups = facts.groups_per_step
        change = _now_then(
            "trainer.groups_per_step",
            groups,
            None if groups is None else 2 * groups,
            "one gradient all-reduce per step: more tokens share it",
        )
    return Finding(
        kind, share / limit, f"{phase} took {share:.0%} of the trainer's time.", [change]
    )


# -- the run directory ---------------------------------------------------------------------------


def trainer_input(steps: Iterable[StepRecord]) -> tuple[TimeSplit | None, TrainerFigures]:
    """The trainer's split and figures over its step lines, the first warm-up steps left out
    when there are enough."""
    timed = [(s, split) for s in steps if (split := split_of(s, TRAINER_PHASES)) is not None]
    if len(timed) > 2 * _WARMUP_STEPS:
        timed = timed[_WARMUP_STEPS:]
    if not timed:
        return None, TrainerFigures()
    mfus = [s.mfu for s, _ in timed if s.mfu is not None]
    syncs = [s.weight_sync_seconds for s, _ in timed if s.weight_sync_seconds is not None]
    return mean_split([split for _, split in timed]), TrainerFigures(
        steps=(timed[0][0].step, timed[-1][0].step),
        mfu=sum(mfus) / len(mfus) if mfus else None,
        weight_sync_seconds=sum(syncs) / len(syncs) if syncs else None,
    )


def rollout_input(records: Iterable[WorkerRecord]) -> TimeSplit | None:
    """All workers' intervals as one split, but for each worker's start and end: the intervals
    before its first published group (the trainer coming up, the first weights) and after its
    last (the run ending) are not the run's pace."""
    by_worker: dict[str, list[WorkerRecord]] = {}
    for r in records:
        by_worker.setdefault(r.worker, []).append(r)
    splits = []
    for rs in by_worker.values():
        first = next((i for i, r in enumerate(rs) if r.groups), len(rs))
        last = max((i for i, r in enumerate(rs) if r.groups), default=-1)
        splits += [s for r in rs[first : last + 1] if (s := split_of(r, ROLLOUT_PHASES))]
    return mean_split(splits)


def latest_splits(
    last_step: Mapping[str, Any] | None, rollout_workers: list[Mapping[str, Any]] | None
) -> tuple[TimeSplit | None, TimeSplit | None]:
    """`asyncrl status`'s input: the split of the last step line, and the live workers' last
    intervals (their heartbeats' `time` fractions) weighted alike."""
    record = read_record(last_step) if last_step is not None else None
    trainer = split_of(record, TRAINER_PHASES) if isinstance(record, StepRecord) else None
    beats = [w.get("time") for w in rollout_workers or []]
    splits = [
        TimeSplit(1.0, {p: float(t[p]) for p in ROLLOUT_PHASES})
        for t in beats
        if isinstance(t, Mapping) and all(isinstance(t.get(p), int | float) for p in ROLLOUT_PHASES)
    ]
    return trainer, mean_split(splits)


def from_run_dir(run_dir: Path) -> tuple[Diagnosis, str]:
    """The diagnosis of a run directory, and the title line naming what it read."""
    from asyncrl.metrics.jsonl import read_jsonl

    log = run_dir / "metrics.jsonl"
    lines = read_jsonl(log) if log.is_file() else []
    steps = [r for r in map(read_record, lines) if isinstance(r, StepRecord)]
    workers = read_worker_log(run_dir)
    trainer, figures = trainer_input(steps)
    facts = _facts(run_dir)
    span = f"steps {figures.steps[0]}–{figures.steps[1]}" if figures.steps else "no steps"
    title = (
        f"asyncrl doctor {run_dir}: {span}, {len({w.worker for w in workers})} rollout worker(s)"
    )
    return diagnose(trainer, rollout_input(workers), figures, facts), title


def _facts(run_dir: Path) -> RunFacts | None:
    """The settings of the run's `config.yaml` (written by the launcher); None without one."""
    from asyncrl.config import ConfigError, load_config

    path = run_dir / "config.yaml"
    if not path.is_file():
        return None
    try:
        return RunFacts.of(load_config(str(path), []))
    except (ConfigError, OSError):
        return None


def main(run_dir: str | Path) -> int:
    """Prints the diagnosis; 1 when the run directory holds no time breakdown at all."""
    diagnosis, title = from_run_dir(Path(run_dir))
    print(diagnosis.render(title))
    return 0 if diagnosis.trainer is not None or diagnosis.rollout is not None else 1
