"""Python agents (`task.agent.type: python`): your function, unchanged, run once per episode in
the process that runs the episode (a rollout worker, or an agent runner).

An `async def` runs as a task on the environments' event loop, a plain function on a thread of
its own for its whole episode. Whatever it raises, a BaseException included, fails only its
group (`agent_error`). A thread cannot be stopped: an episode given up ends its session, so the
function's next call fails at once.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import TYPE_CHECKING, Any

from asyncrl.environments.base import contained
from asyncrl.plugins import load_object

if TYPE_CHECKING:
    from asyncrl.agents.config import PythonAgentConfig

_THREADS = 256
"""Sync agents running at once in a worker (a thread each, for their whole episode)."""


class PythonAgent:
    def __init__(self, cfg: PythonAgentConfig) -> None:
        self.cfg = cfg
        self._fn = load_object(cfg.path, cfg.python_path)
        self._threads: ThreadPoolExecutor | None = None

    async def run(self, item: dict[str, Any], base_url: str, api_key: str) -> Any:
        call = partial(self._fn, item, base_url=base_url, api_key=api_key, **self.cfg.kwargs)
        return await contained(self._call(call))

    async def _call(self, call: Callable[[], Any]) -> Any:
        if inspect.iscoroutinefunction(self._fn):
            return await call()
        if self._threads is None:
            self._threads = ThreadPoolExecutor(_THREADS, thread_name_prefix="agent")
        value = await asyncio.get_running_loop().run_in_executor(self._threads, call)
        return await value if inspect.isawaitable(value) else value

    def shutdown(self) -> None:
        if self._threads is not None:
            self._threads.shutdown(wait=False, cancel_futures=True)
