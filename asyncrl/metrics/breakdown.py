"""Where a role's wall time goes: each process splits its main thread's time into phases, and
reports the split per interval as fractions that sum to 1.

A `Breakdown` keeps exclusive time: entering a phase pauses the one it is nested in, and time in
no phase is `other`, so the phases of an interval add up to its wall time exactly. Code that
wants its time counted names a phase with the module's `phase(name)`: it charges the breakdown
activated on the calling thread, and costs a thread-local lookup when none is (or when the role
does not know that phase: the trainer's evaluation runs the engine, whose `prefill` then stays
in the trainer's `other`). Only the role's own thread is measured; the weight-sync and prefetch
threads overlap it and are not part of its wall time.

Timing is host wall time without device synchronisation: on an accelerator an asynchronous
kernel is charged to the phase that waits for it (the trainer's per-micro-batch loss read, the
engine's sampled tokens), which is where the role's thread spends that time anyway.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass
from time import perf_counter
from types import TracebackType
from typing import Any, Protocol

OTHER = "other"

TRAINER_PHASES = (
    "wait",
    "collate",
    "proximal",
    "forward_backward",
    "all_reduce",
    "optimizer",
    "publish",
    "checkpoint",
    OTHER,
)
"""The trainer's step, from the end of one step record to the end of the next: waiting for
trajectories, turning groups into padded micro-batches, the proximal log-probs and correction
weights (π_prox is the step's own forward, detached: this is the weights' arithmetic, no second
forward), forward and backward (FSDP's reduce-scatter included), the explicit gradient
all-reduce of replicated ranks, clipping and the optimizer step, handing the weights to the
publisher (the blocking part), writing a checkpoint (charged to the step after it)."""

ROLLOUT_PHASES = (
    "prefill",
    "decode",
    "generate",
    "env",
    "hold",
    "weight_swap",
    "publish",
    OTHER,
)
"""A rollout worker's loop: the engine's prefill and decode steps (the builtin engine; an
engine that cannot tell them apart, SGLang, is one `generate`), waiting on environments, tools,
agents and rewards with nothing ready to generate, waiting for prompts or for the weights held
prompts need (the generation hold), applying staged weights between decode steps, publishing
groups."""

ROLE_PHASES = {"trainer": TRAINER_PHASES, "rollout": ROLLOUT_PHASES}
ALL_PHASES = tuple(dict.fromkeys((*TRAINER_PHASES, *ROLLOUT_PHASES)))
"""Every phase name, for the Prometheus label (each role sets its own)."""


@dataclass(frozen=True)
class TimeSplit:
    """One interval of one role: its wall seconds, and the fraction of them each phase took
    (every phase of the role, summing to 1)."""

    seconds: float
    fractions: Mapping[str, float]

    @classmethod
    def of(cls, seconds_by_phase: Mapping[str, float]) -> TimeSplit:
        """The split of phases' exclusive seconds; all zero reads as all `other`."""
        total = sum(seconds_by_phase.values())
        if total <= 0:
            return cls(0.0, {p: float(p == OTHER) for p in seconds_by_phase})
        return cls(total, {p: s / total for p, s in seconds_by_phase.items()})

    def fields(self) -> dict[str, Any]:
        """The record fields of the split: `breakdown_seconds` and `time_{phase}`."""
        return {"breakdown_seconds": self.seconds} | {
            f"time_{p}": f for p, f in self.fractions.items()
        }


def split_of(record: object, phases: tuple[str, ...]) -> TimeSplit | None:
    """The split a record's `time_{phase}` fields hold; None when it lacks any of them."""
    fractions = {p: getattr(record, f"time_{p}", None) for p in phases}
    seconds = getattr(record, "breakdown_seconds", None)
    if seconds is None or any(f is None for f in fractions.values()):
        return None
    return TimeSplit(float(seconds), {p: float(f) for p, f in fractions.items() if f is not None})


def mean_split(splits: list[TimeSplit]) -> TimeSplit | None:
    """The splits of several intervals as one: fractions weighted by each interval's seconds."""
    total = sum(s.seconds for s in splits)
    if not splits or total <= 0:
        return None
    phases = splits[0].fractions.keys()
    return TimeSplit(
        total, {p: sum(s.fractions.get(p, 0.0) * s.seconds for s in splits) / total for p in phases}
    )


class _Phase:
    """The context manager of one phase of one breakdown (made once, entered many times)."""

    __slots__ = ("_breakdown", "_name")

    def __init__(self, breakdown: Breakdown, name: str) -> None:
        self._breakdown = breakdown
        self._name = name

    def __enter__(self) -> None:
        self._breakdown.enter(self._name)

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._breakdown.leave()


class _NoPhase:
    __slots__ = ()

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


_NO_PHASE = _NoPhase()


class Counts(Protocol):
    """What a breakdown adds each charge to (a Prometheus counter)."""

    def inc(self, amount: float) -> None: ...


class Breakdown:
    """Exclusive seconds per phase of one thread since the last `take` (see the module).

    With `counters` (one per phase), each stretch of a phase is also added to its counter as it
    ends (the phase left, or paused by one nested in it, or cut by a `take`), so a scrape sees
    the time so far rather than the last interval's."""

    def __init__(
        self, phases: tuple[str, ...], counters: Mapping[str, Counts] | None = None
    ) -> None:
        self.phases = phases
        self._seconds = dict.fromkeys(phases, 0.0)
        self._phases = {p: _Phase(self, p) for p in phases}
        self._stack = [OTHER]
        self._start = self._mark = perf_counter()
        self._counters = None if counters is None else {p: counters[p] for p in phases}

    def phase(self, name: str) -> _Phase | _NoPhase:
        """The context manager charging `name`; a no-op for a phase this role does not have."""
        return self._phases.get(name, _NO_PHASE)

    def enter(self, name: str) -> None:
        self._charge(self._stack[-1])
        self._stack.append(name)

    def leave(self) -> None:
        self._charge(self._stack.pop())

    def _charge(self, name: str) -> None:
        """`name` ran from the last mark until now."""
        now = perf_counter()
        seconds = now - self._mark
        self._seconds[name] += seconds
        self._mark = now
        if self._counters is not None:
            self._counters[name].inc(seconds)

    def elapsed(self) -> float:
        """Seconds since the last `take`."""
        return perf_counter() - self._start

    def take(self) -> TimeSplit:
        """The interval since the last `take` (or the start), and a new interval begun."""
        self._charge(self._stack[-1])
        split = TimeSplit.of(self._seconds)
        self._seconds = dict.fromkeys(self.phases, 0.0)
        self._start = self._mark
        return split

    def activate(self) -> Breakdown:
        """Make this the breakdown `phase()` charges on the calling thread."""
        _local.breakdown = self
        return self


_local = threading.local()


def phase(name: str) -> _Phase | _NoPhase:
    """A context manager charging the block to `name` in the calling thread's breakdown; a
    no-op when the thread has none or that has no such phase."""
    breakdown: Breakdown | None = getattr(_local, "breakdown", None)
    return _NO_PHASE if breakdown is None else breakdown.phase(name)


def deactivate() -> None:
    """The calling thread's breakdown no longer charged (a role that ends; tests)."""
    _local.breakdown = None
