"""The event loop thread an `EpisodeScheduler`'s environments run on.

Environment calls (`reset`, `step`, `close`) are tasks on one event loop in a thread of its own:
an episode waiting on its tools costs a timer, where a thread each would cost a millisecond of
CPU per step in switching. The generating thread sends calls in batches (one wakeup of the loop
per generate call) and takes their results back from a queue, each with the key it sent. User
code that ends the loop itself, past every guard, is heard of at once (`EnvironmentLoopDied`),
where the generating thread would otherwise wait forever for the calls in flight.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from asyncrl.environments.base import (
    Environment,
    Escaped,
    Observation,
    StepResult,
    contained,
    reset_checked,
    step_checked,
)
from asyncrl.items import PromptItem

K = TypeVar("K")
log = logging.getLogger(__name__)

_CLOSE_TIMEOUT_S = 10.0
_REVIVALS = 100
"""Runs of a dead event loop `close` tries before it gives up on its environments."""


def describe(exc: BaseException) -> str:
    return str(exc) if isinstance(exc, Escaped) else f"{type(exc).__name__}: {exc}"


class EnvironmentLoopDied(RuntimeError):
    """The event loop that runs the environments ended by itself: user code got past what
    guards its calls (a task or callback it started raised SystemExit, it stopped the loop).
    Every episode inside an environment is lost with it, so the scheduler cannot go on."""


@dataclass(frozen=True)
class Reset:
    first: Observation


@dataclass(frozen=True)
class Posted:
    """Handed in from another thread, outside any call sent (an agent's call, from the
    gateway's HTTP thread): it wakes `take_back` but is no call's result."""

    value: Any


Returned = Reset | StepResult | Exception | Any
"""What an environment call hands back to the generating thread: its failure too (a failing
environment fails its group, never the worker); or what other work `spawn`ed returned, or
something `post`ed."""

Call = tuple[K, Environment, PromptItem | str]
"""An environment call to make: `reset` of the item, or `step` of the text; the key comes back
with its result."""


class EnvironmentLoop(Generic[K]):
    """Environment calls run on one event loop thread, started on first use; every method but
    the coroutines is called from the generating thread."""

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self.steps: set[asyncio.Task[None]] = set()  # the loop keeps only weak references
        self._closing: set[asyncio.Task[None]] = set()  # environments being closed
        # Environments not yet handed to `_spawn_close`, by id (an environment need not be
        # hashable): what `close` ends when it cuts episodes short.
        self._open: dict[int, Environment] = {}
        self._returned: queue.SimpleQueue[tuple[K, Returned] | EnvironmentLoopDied] = (
            queue.SimpleQueue()
        )
        self._died: EnvironmentLoopDied | None = None
        self._stopping = False  # `close` ends the loop: its end is no death
        self.pending = 0
        """Calls sent whose results are not taken back yet."""

    def opened(self, env: Environment) -> None:
        """`env` is one to close, at the latest when the loop closes."""
        self._open[id(env)] = env

    def send(self, calls: Sequence[Call[K]]) -> None:
        self.pending += len(calls)
        self._event_loop().call_soon_threadsafe(self._spawn, calls)

    def spawn(self, key: K, work: Callable[[], Awaitable[Any]]) -> None:
        """Run `work()` on the loop; its value (or the Exception it raised) comes back with
        `key`. Cancelled by `close`, like environment steps."""
        self.pending += 1
        self._event_loop().call_soon_threadsafe(
            lambda: self._track(self._run(key, work), self.steps)
        )

    def post(self, key: K, value: Any) -> None:
        """Hand `value` to the generating thread as `Posted` (from any thread)."""
        self._returned.put((key, Posted(value)))

    def close_env(self, env: Environment) -> None:
        self._open.pop(id(env), None)
        self._event_loop().call_soon_threadsafe(self._spawn_close, env)

    def take_back(self, wait_s: float) -> list[tuple[K, Returned]]:
        """The results returned so far, waiting up to `wait_s` for a first one;
        `EnvironmentLoopDied` (now and on every later call) once the loop ended by itself."""
        if self._died is not None:
            raise self._died
        got = []
        if wait_s > 0:
            try:
                got.append(self._returned.get(timeout=wait_s))
            except queue.Empty:
                return []
        while True:
            try:
                got.append(self._returned.get_nowait())
            except queue.Empty:
                break
        returned = [r for r in got if not isinstance(r, EnvironmentLoopDied)]
        if len(returned) < len(got):
            self._died = next(r for r in got if isinstance(r, EnvironmentLoopDied))
            raise self._died
        self.pending -= sum(not isinstance(r, Posted) for _, r in returned)
        return returned

    def close(self) -> None:
        """Cancel the environment steps still awaiting their tools, close every environment
        still open (episodes cut short: a session on an env-server is deleted), best effort
        within a few seconds, and end the loop thread."""
        if self._loop is None:
            return
        left, self._open = list(self._open.values()), {}
        assert self._thread is not None
        if self._thread.is_alive():
            cancelled = asyncio.run_coroutine_threadsafe(self._cancel_steps(left), self._loop)
            try:
                cancelled.result(timeout=_CLOSE_TIMEOUT_S)
            except TimeoutError:
                log.warning("environment steps ignored cancellation for %.0fs", _CLOSE_TIMEOUT_S)
        else:
            self._close_on_dead_loop(left)
        self._stopping = True
        self._loop.call_soon_threadsafe(self._loop.stop)
        if self._thread is not None:
            self._thread.join(_CLOSE_TIMEOUT_S)
        if not self._loop.is_running():
            self._loop.close()
        self._loop = self._thread = None

    def _close_on_dead_loop(self, left: list[Environment]) -> None:
        """`close` after the loop's thread died: its tasks (the steps, sessions to delete) are
        wound up on this thread instead, bounded as there."""
        loop = self._loop
        assert loop is not None
        wound_up = loop.create_task(asyncio.wait_for(self._cancel_steps(left), _CLOSE_TIMEOUT_S))
        # The code that ended the loop may have left more of the same in its queue: each run
        # past one goes on from the next callback.
        for _ in range(_REVIVALS):
            try:
                loop.run_until_complete(wound_up)
                return
            except BaseException as exc:
                last = exc
        log.warning("environments not closed after their event loop died: %s", describe(last))

    async def _cancel_steps(self, left: list[Environment]) -> None:
        for task in self.steps:
            task.cancel()
        await asyncio.gather(*self.steps, return_exceptions=True)
        for env in left:
            self._spawn_close(env)
        # Episodes release what they hold (a session on an env-server) before the loop goes; a
        # close that hangs is cut off.
        if self._closing:
            _, stuck = await asyncio.wait(self._closing, timeout=_CLOSE_TIMEOUT_S / 2)
            for task in stuck:
                task.cancel()
            await asyncio.gather(*stuck, return_exceptions=True)

    def _event_loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            self._loop = asyncio.new_event_loop()
            self._thread = threading.Thread(
                target=self._run_loop, args=(self._loop,), name="env-loop", daemon=True
            )
            self._thread.start()
        return self._loop

    def _run_loop(self, loop: asyncio.AbstractEventLoop) -> None:
        """The loop thread. Should user code end the loop anyway, the generating thread hears
        of it at once (`EnvironmentLoopDied` from `take_back`), where it would wait forever for
        the steps in flight."""
        try:
            loop.run_forever()
        except BaseException as exc:
            died = f"the environments' event loop died of {describe(exc)}"
        else:
            if self._stopping:
                return
            died = "the environments' event loop was stopped (by an environment's code)"
        self._returned.put(EnvironmentLoopDied(died))

    def _spawn(self, calls: Sequence[Call[K]]) -> None:
        """On the loop thread: start the environment calls of one generate call."""
        for key, env, what in calls:
            self._track(self._call(key, env, what), self.steps)

    def _spawn_close(self, env: Environment) -> None:
        self._track(self._close(env), self._closing)

    def _track(self, call: Coroutine[Any, Any, None], tasks: set[asyncio.Task[None]]) -> None:
        assert self._loop is not None
        task = self._loop.create_task(call)
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    async def _call(self, key: K, env: Environment, what: PromptItem | str) -> None:
        result: Returned
        try:
            if isinstance(what, str):
                result = await step_checked(env, what)
            else:
                result = Reset(await reset_checked(env, what))
        except Exception as exc:  # a failing environment fails its group, never the worker
            result = exc
        self._returned.put((key, result))

    async def _run(self, key: K, work: Callable[[], Awaitable[Any]]) -> None:
        try:
            result = await contained(work())
        except Exception as exc:
            result = exc
        self._returned.put((key, result))

    @staticmethod
    async def _close(env: Environment) -> None:
        try:
            await contained(env.close())
        except Exception:  # the episode is over: nothing to fail any more
            log.warning("closing an environment failed", exc_info=True)
