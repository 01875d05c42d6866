"""Environments of multi-turn episodes: the `Environment` protocol users implement
(`base.py`), by import path in the worker (`local.py`) or served out of process by
`asyncrl env-server` (`server.py`, `client.py`), and tools the policy calls in its output
(`tools.py`); `build_environments` picks by config `type`.
Importing this package imports no config library (the metric table names its reasons)."""

from asyncrl.environments.base import Environment, StepResult, build_environments

__all__ = ["Environment", "StepResult", "build_environments"]
