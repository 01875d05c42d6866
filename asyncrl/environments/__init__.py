"""Environments of multi-turn episodes: the `Environment` protocol users implement
(`base.py`), by import path in the worker (`local.py`) or served out of process by
`asyncrl env-server` (`server.py`, `client.py`); `build_environments` picks by config `type`."""

from __future__ import annotations

from typing import assert_never

from asyncrl.environments.base import Environment, EnvironmentFactory, StepResult
from asyncrl.environments.config import (
    EnvironmentConfig,
    PythonEnvironmentConfig,
    RemoteEnvironmentConfig,
)

__all__ = ["Environment", "StepResult", "build_environments"]


def build_environments(cfg: EnvironmentConfig) -> EnvironmentFactory:
    """The factory of one episode's environment under `cfg`."""
    match cfg:
        case PythonEnvironmentConfig():
            from asyncrl.environments.local import TimedEnvironment, check_class

            cls = check_class(cfg.path, cfg.python_path, cfg.kwargs)
            return lambda item, episode_id: TimedEnvironment(cls(**cfg.kwargs), cfg.timeout_s)
        case RemoteEnvironmentConfig():
            from asyncrl.environments.client import RemotePool

            pool = RemotePool(cfg)
            return lambda item, episode_id: pool.environment()
        case _:
            assert_never(cfg)
