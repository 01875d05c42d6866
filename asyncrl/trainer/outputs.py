"""Where trainer rank 0 reports what each step and evaluation measured: the role's Prometheus
metrics, `metrics.jsonl`, the experiment trackers, `mismatch.jsonl` (the step's full mismatch
tables) and the run's `last_step` key (`asyncrl status`)."""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING

from asyncrl.algo.mismatch import LOW_PROB, summarise
from asyncrl.metrics.breakdown import TRAINER_PHASES, split_of
from asyncrl.redis_conn import Stopped

if TYPE_CHECKING:
    from collections.abc import Iterable

    from asyncrl.metrics.jsonl import JsonlWriter
    from asyncrl.metrics.record import EvalRecord, StepRecord
    from asyncrl.metrics.trackers import TrackerFeed
    from asyncrl.runtime import RoleRuntime
    from asyncrl.trainer.step import StepStats


@dataclass(frozen=True)
class StepOutputs:
    runtime: RoleRuntime
    jsonl: JsonlWriter | None
    """The metrics.jsonl writer; None with `metrics.jsonl: false`."""
    mismatch_log: JsonlWriter | None
    """The step's full mismatch tables (`asyncrl mismatch RUN_DIR`); None with
    `metrics.jsonl: false`."""
    trackers: TrackerFeed | None
    """The experiment trackers fed the same records; None without `metrics.trackers`."""

    def step(self, record: StepRecord, staleness: Iterable[int], stats: StepStats) -> None:
        rt = self.runtime
        rt.metrics.observe_step(record, staleness)
        split = split_of(record, TRAINER_PHASES)
        if split is not None:
            rt.metrics.observe_split(split)
        line = record.to_json()
        if self.jsonl is not None:
            self.jsonl.write(line)
        if self.trackers is not None:
            self.trackers.log(record)
        if self.mismatch_log is not None:
            self.mismatch_log.write(self._mismatch_line(record, stats))
        # Only `asyncrl status` reads it: SIGTERM in an outage skips it, the step is complete.
        with contextlib.suppress(Stopped):
            rt.redis.call(
                lambda: rt.client.set(rt.keys.last_step, json.dumps(line)), "write last_step"
            )

    def evaluation(self, record: EvalRecord) -> None:
        self.runtime.metrics.eval_accuracy.set(record.eval_accuracy)
        if self.jsonl is not None:
            self.jsonl.write(record.to_json())
        if self.trackers is not None:
            self.trackers.log(record)

    def close(self) -> None:
        if self.trackers is not None:
            self.trackers.close()
        if self.mismatch_log is not None:
            self.mismatch_log.close()

    def _mismatch_line(self, record: StepRecord, stats: StepStats) -> dict[str, object]:
        """One line of `mismatch.jsonl`: the step's tables, labelled with the engine and the
        dtypes on both sides."""
        cfg = self.runtime.cfg
        engine = cfg.rollout.engine
        return {
            "step": record.step,
            "version": record.version,
            "engine": engine.type,
            "engine_dtype": getattr(engine, "dtype", None),
            "trainer_dtype": cfg.trainer.dtype,
            "low_prob": LOW_PROB,
            "trained": summarise(stats.mismatch),
            "audit": summarise(stats.audit),
            **(
                {"routing": {"replay": cfg.algo.routing_replay, **summary}}
                if stats.routing is not None and (summary := stats.routing.summary())
                else {}
            ),
        }
