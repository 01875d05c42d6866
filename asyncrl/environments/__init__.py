"""Environments of multi-turn episodes: the `Environment` protocol users implement
(`base.py`), by import path in the worker (`local.py`) or served out of process by
`asyncrl env-server` (`server.py`, `client.py`), and tools the policy calls in its output
(`tools.py`). Which one a task's episodes get is chosen by config `type` in
`asyncrl.tasks.build`; nothing here imports a task."""

from asyncrl.environments.base import Environment, StepResult

__all__ = ["Environment", "StepResult"]
