"""Config of the metrics outputs: the `/metrics` endpoint, the JSONL log and the experiment
trackers fed beside it (`asyncrl.metrics.trackers`), one union member per tracker, chosen by
`type`. Imports no tracker package, so config validation stays fast."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from asyncrl.configbase import Section


class WandbTrackerConfig(Section):
    """Weights & Biases (`pip install 'asyncrl[wandb]'`); online needs `WANDB_API_KEY` or a
    `wandb login` on the trainer's host."""

    type: Literal["wandb"]
    """Tracker backend."""
    project: str = "asyncrl"
    """W&B project."""
    entity: str | None = None
    """W&B team or user; None: the API key's default entity."""
    name: str | None = None
    """Run name shown in W&B; None: `run.id`. Each trainer start is a W&B run of its own."""
    mode: Literal["online", "offline"] = "online"
    """`offline` writes the run under `dir` only, for `wandb sync` later."""
    dir: str | None = None
    """Where wandb writes its files (a `wandb/` folder); None: `run.dir`."""


class TensorboardTrackerConfig(Section):
    """TensorBoard event files (`pip install 'asyncrl[tensorboard]'`): one scalar per figure."""

    type: Literal["tensorboard"]
    """Tracker backend."""
    dir: str | None = None
    """Log directory (`tensorboard --logdir` it); None: `{run.dir}/tensorboard`."""


class MlflowTrackerConfig(Section):
    """MLflow (`pip install 'asyncrl[mlflow]'`): a tracking server or a local file store."""

    type: Literal["mlflow"]
    """Tracker backend."""
    tracking_uri: str | None = None
    """e.g. `http://mlflow:5000` or `file:///path/mlruns`; None: `MLFLOW_TRACKING_URI`, else
    MLflow's default (`./mlruns`)."""
    experiment: str = "asyncrl"
    """Experiment name, created when missing."""
    run_name: str | None = None
    """Run name; None: `run.id`. Each trainer start is an MLflow run of its own."""


TrackerConfig = Annotated[
    WandbTrackerConfig | TensorboardTrackerConfig | MlflowTrackerConfig,
    Field(discriminator="type"),
]


class MetricsConfig(Section):
    host: str = "127.0.0.1"
    """Bind address of /metrics and /healthz (loopback by default; 0.0.0.0 in containers)."""
    port: int = Field(default=9400, ge=0, le=65535)
    """Port of this process' /metrics; local mode gives child i the port + i. 0 disables. A
    port another process holds is a config error (exit 2) naming this key."""
    jsonl: bool = True
    """Write {run.dir}/metrics.jsonl (trainer) and {run.dir}/rollout.jsonl (rollout workers)."""
    breakdown_every_s: float = Field(default=10.0, gt=0)
    """Seconds between a rollout worker's time-breakdown lines (rollout.jsonl, Prometheus,
    its heartbeat); the trainer's breakdown is per step."""
    trackers: list[TrackerConfig] = Field(default_factory=list)
    """Experiment trackers trainer rank 0 feeds the same step and eval records as the JSONL
    log, e.g. `[{type: tensorboard}, {type: wandb, project: p}]`; a tracker that fails is
    logged once and dropped, never stopping training."""
