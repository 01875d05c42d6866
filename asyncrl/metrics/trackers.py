"""Experiment trackers beside the JSONL log: Weights & Biases, TensorBoard, MLflow.

Trainer rank 0 hands every `StepRecord` and `EvalRecord` it writes to `metrics.jsonl` to
`TrackerFeed`, which passes them to the trackers of `metrics.trackers` from a thread of its own:
a tracker that is slow or hangs (a remote MLflow retrying for minutes, `wandb.init` waiting on
the network) never holds up a step, and one that fails, to start or on a record, is logged once
with the reason and dropped for the rest of the run. Each figure is logged under its JSONL key
(`reward_mean`, `loss`, ..., `eval_accuracy`) at the record's `step`. Each backend's package is
an optional extra, imported only when a tracker of its type is built.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import queue
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from asyncrl.metrics.record import EvalRecord, Record, StepRecord

if TYPE_CHECKING:
    from asyncrl.metrics.config import (
        MlflowTrackerConfig,
        TensorboardTrackerConfig,
        TrackerConfig,
        WandbTrackerConfig,
    )

log = logging.getLogger(__name__)


class Tracker(Protocol):
    """One experiment tracker. Calls come from one thread, in the order the records were written;
    any exception drops the tracker (the JSONL log stays the record of the run)."""

    def log_step(self, record: StepRecord) -> None: ...

    def log_eval(self, record: EvalRecord) -> None: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class RunInfo:
    """What a tracker names its run by and where it writes by default."""

    id: str
    dir: Path
    config: dict[str, Any]
    """The resolved config, secrets redacted (`Config.redacted()`)."""


def scalars(record: Record) -> dict[str, float]:
    """The figures of a record by JSONL key: numbers and booleans (as 0/1) but `step`; an eval
    record's is its `eval_accuracy` alone (its wall time is the step line's)."""
    if isinstance(record, EvalRecord):
        return {"eval_accuracy": record.eval_accuracy}
    return {
        k: float(v)
        for k, v in record.to_json().items()
        if k != "step" and isinstance(v, int | float)
    }


class WandbTracker:
    def __init__(self, cfg: WandbTrackerConfig, run: RunInfo) -> None:
        import wandb

        self._run = wandb.init(
            project=cfg.project,
            entity=cfg.entity,
            name=cfg.name or run.id,
            mode=cfg.mode,
            dir=cfg.dir or str(run.dir),
            config=run.config,
        )

    def log_step(self, record: StepRecord) -> None:
        self._run.log(scalars(record), step=record.step)

    def log_eval(self, record: EvalRecord) -> None:
        # The step line of the same step was logged first: W&B merges the two.
        self._run.log(scalars(record), step=record.step)

    def close(self) -> None:
        self._run.finish()


class TensorboardTracker:
    def __init__(self, cfg: TensorboardTrackerConfig, run: RunInfo) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(cfg.dir or str(run.dir / "tensorboard"))

    def _write(self, record: Record) -> None:
        for key, value in scalars(record).items():
            self._writer.add_scalar(key, value, record.step)
        self._writer.flush()  # a step is seconds apart: TensorBoard shows it at once

    log_step = _write
    log_eval = _write

    def close(self) -> None:
        self._writer.close()


class MlflowTracker:
    def __init__(self, cfg: MlflowTrackerConfig, run: RunInfo) -> None:
        from mlflow.tracking import MlflowClient

        # A client of its own, not mlflow's global active run: nothing else in the process
        # (a user's plugin, say) is logged into this run or ends it.
        self._client = MlflowClient(tracking_uri=cfg.tracking_uri)
        experiment = self._client.get_experiment_by_name(cfg.experiment)
        experiment_id = (
            experiment.experiment_id
            if experiment is not None
            else self._client.create_experiment(cfg.experiment)
        )
        self._run_id = self._client.create_run(
            experiment_id, run_name=cfg.run_name or run.id
        ).info.run_id
        self._client.log_dict(self._run_id, run.config, "config.json")

    def _write(self, record: Record) -> None:
        from mlflow.entities import Metric

        at = int(1000 * time.time())
        metrics = [Metric(k, v, at, record.step) for k, v in scalars(record).items()]
        self._client.log_batch(self._run_id, metrics=metrics)

    log_step = _write
    log_eval = _write

    def close(self) -> None:
        self._client.set_terminated(self._run_id)


def build_tracker(cfg: TrackerConfig, run: RunInfo) -> Tracker:
    """The tracker of `cfg.type`; imports its package (an optional extra) only now."""
    if cfg.type == "wandb":
        return WandbTracker(cfg, run)
    if cfg.type == "tensorboard":
        return TensorboardTracker(cfg, run)
    return MlflowTracker(cfg, run)


_PACKAGES = {"wandb": "wandb", "tensorboard": "tensorboard", "mlflow": "mlflow"}
"""The package each tracker type imports, installed by the extra of the type's name."""


def missing_package(configs: list[TrackerConfig]) -> str | None:
    """A config error naming the first tracker whose package is not installed, else None; for
    the launcher, before anything starts (a tracker that cannot start later is only logged)."""
    for i, cfg in enumerate(configs):
        package = _PACKAGES[cfg.type]
        if importlib.util.find_spec(package) is None:
            return (
                f"metrics.trackers.{i}.type: {cfg.type} needs the {package} package: "
                f"pip install 'asyncrl[{cfg.type}]'"
            )
    return None


_CLOSE = object()
"""Put on the queue by `close`: the thread closes the trackers and ends."""


class TrackerFeed:
    """Feeds the trackers of `metrics.trackers` from a daemon thread, which builds them first.

    `log` never blocks: records are queued (at most `max_queued`; beyond that they are dropped
    and counted, as a tracker that keeps up needs no more). `close` lets the thread finish what
    is queued and close the trackers, waiting at most `close_timeout_s`, so a hanging tracker
    cannot keep the trainer from exiting.
    """

    def __init__(
        self,
        configs: list[TrackerConfig],
        run: RunInfo,
        max_queued: int = 10_000,
        close_timeout_s: float = 60.0,
    ) -> None:
        self.close_timeout_s = close_timeout_s
        self.dropped = 0
        self._queue: queue.Queue[object] = queue.Queue(max_queued)
        self._thread = threading.Thread(
            target=self._run, args=(configs, run), name="trackers", daemon=True
        )
        self._thread.start()

    def log(self, record: Record) -> None:
        try:
            self._queue.put_nowait(record)
        except queue.Full:
            self.dropped += 1

    def close(self) -> None:
        with contextlib.suppress(queue.Full):  # a thread that hangs: the join below times out
            self._queue.put(_CLOSE, timeout=self.close_timeout_s)
        self._thread.join(self.close_timeout_s)
        if self._thread.is_alive():
            log.warning(
                "trackers: not done after %.0f s; exiting without them", self.close_timeout_s
            )
        if self.dropped:
            log.warning("trackers: %d record(s) dropped: the trackers fell behind", self.dropped)

    def _run(self, configs: list[TrackerConfig], run: RunInfo) -> None:
        live: dict[str, Tracker] = {}
        for i, cfg in enumerate(configs):
            name = f"metrics.trackers.{i} ({cfg.type})"
            try:
                live[name] = build_tracker(cfg, run)
            except Exception as exc:  # a missing package, no network, no credentials: no tracker
                _dropped(name, "could not start", exc)
        while (item := self._queue.get()) is not _CLOSE:
            for name, tracker in list(live.items()):
                try:
                    if isinstance(item, EvalRecord):
                        tracker.log_eval(item)
                    else:
                        assert isinstance(item, StepRecord)
                        tracker.log_step(item)
                except Exception as exc:  # network, disk, the tracker's own bug: drop it
                    _dropped(name, "failed", exc)
                    del live[name]
        for name, tracker in live.items():
            try:
                tracker.close()
            except Exception as exc:
                _dropped(name, "failed to close", exc)


def _dropped(name: str, what: str, exc: BaseException) -> None:
    log.warning(
        "tracker %s %s, logging to it no more (training goes on; metrics.jsonl has every "
        "record): %s: %s",
        name,
        what,
        type(exc).__name__,
        exc,
    )
