"""A rollout worker's time breakdown: its Prometheus seconds per phase advance as each phase
ends; every `metrics.breakdown_every_s` the interval is reported as a `WorkerRecord` line in
`{run.dir}/rollout.jsonl`, the shares gauge and the fractions in its heartbeat (`asyncrl
status`)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from asyncrl.metrics.breakdown import ROLLOUT_PHASES, Breakdown, deactivate
from asyncrl.metrics.record import ROLLOUT_LOG, WorkerRecord

if TYPE_CHECKING:
    from asyncrl.metrics.jsonl import JsonlWriter
    from asyncrl.runtime import RoleRuntime


class WorkerTiming:
    def __init__(
        self, rt: RoleRuntime, version: Callable[[], int], tokens: Callable[[], int]
    ) -> None:
        self._rt = rt
        self._version = version
        self._tokens = tokens
        self._every_s = rt.cfg.metrics.breakdown_every_s
        self.breakdown = Breakdown(ROLLOUT_PHASES)  # counts nothing until `start`
        self._t0 = time.monotonic()
        self._tokens_at = 0
        self._groups = 0
        self._log: JsonlWriter | None = None
        self.last: dict[str, float] = {}
        """The last interval's fractions by phase (the heartbeat's `time`); empty before it."""

    def start(self) -> None:
        """Begin measuring the calling thread (the worker's loop)."""
        self._t0 = time.monotonic()
        self._tokens_at = self._tokens()
        # A new breakdown, so that the worker's start-up is in no counter.
        self.breakdown = Breakdown(ROLLOUT_PHASES, self._rt.metrics.breakdown_seconds).activate()

    def published(self, groups: int) -> None:
        self._groups += groups

    def tick(self) -> None:
        """Report the interval once it is `metrics.breakdown_every_s` long."""
        if self.breakdown.elapsed() >= self._every_s:
            self.report()

    def report(self) -> WorkerRecord:
        split = self.breakdown.take()
        tokens = self._tokens()
        record = WorkerRecord(
            worker=self._rt.name,
            wall_seconds=round(time.monotonic() - self._t0, 3),
            version=self._version(),
            tokens=tokens - self._tokens_at,
            groups=self._groups,
            **split.fields(),
        )
        self._tokens_at, self._groups = tokens, 0
        self._rt.metrics.observe_fractions(split)
        self.last = {p: round(f, 4) for p, f in split.fractions.items()}
        if self._rt.cfg.metrics.jsonl:
            if self._log is None:
                from asyncrl.metrics.jsonl import JsonlWriter

                self._log = JsonlWriter(self._rt.cfg.run.path / ROLLOUT_LOG)
            self._log.write(record.to_json())
        return record

    def close(self) -> None:
        """Report the last interval and stop measuring."""
        self.report()
        deactivate()
        if self._log is not None:
            self._log.close()
