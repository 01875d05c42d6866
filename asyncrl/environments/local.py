"""Environments by import path, run in this process: loading, checking, and the per-call
timeout."""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Awaitable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from asyncrl.environments.base import (
    Environment,
    EnvironmentFailure,
    Escaped,
    contained,
    reset_checked,
    step_checked,
)
from asyncrl.plugins import call_shape, check_signature, load_object
from asyncrl.reasons import EnvReason

if TYPE_CHECKING:
    from asyncrl.environments.base import Observation, StepResult
    from asyncrl.items import PromptItem

T = TypeVar("T")
log = logging.getLogger(__name__)
_METHODS = ("reset", "step", "close")


def check_class(path: str, python_path: Sequence[str], kwargs: dict[str, Any]) -> type[Any]:
    """The environment class named by `path`; ValueError with a one-line reason when it does not
    import, lacks a coroutine of the protocol or cannot take `kwargs`."""
    cls = load_object(path, python_path)
    if not isinstance(cls, type):
        raise ValueError(f"{path!r} is a {type(cls).__name__}, not a class")
    for name in _METHODS:
        if not inspect.iscoroutinefunction(getattr(cls, name, None)):
            raise ValueError(
                f"{path!r} has no `async def {name}` (an Environment needs {_METHODS})"
            )
    check_signature(cls, call_shape(cls.__name__, [], kwargs), **kwargs)
    return cls


class TimedEnvironment:
    """An environment whose every call fails with `env_timeout` past `timeout_s`, with
    `env_error` when it raises anything (`sys.exit()` included), and whose replies are checked
    against the protocol (`env_malformed` otherwise)."""

    def __init__(self, env: Environment, timeout_s: float) -> None:
        self._env = env
        self._timeout_s = timeout_s

    async def reset(self, item: PromptItem) -> Observation:
        return await self._timed(reset_checked(self._env, item), "reset")

    async def step(self, response: str) -> StepResult:
        return await self._timed(step_checked(self._env, response), "step")

    async def close(self) -> None:
        await self._timed(contained(self._env.close()), "close")

    async def _timed(self, call: Awaitable[T], name: str) -> T:
        try:
            return await asyncio.wait_for(call, self._timeout_s)
        except TimeoutError:
            raise EnvironmentFailure(
                EnvReason.TIMEOUT, f"{name} took over {self._timeout_s}s"
            ) from None
        except Escaped as exc:
            raise EnvironmentFailure(EnvReason.ERROR, f"{name} raised {exc}") from None
