"""The event loop thread episodes run on.

Every episode but a one-turn one is a task on one event loop in a thread of its own (`spawn`):
an episode waiting on its tools costs a timer, where a thread each would cost a millisecond of
CPU per step in switching. What the loop hands the generating thread — an episode's turn to
generate, a score to compute, the end of an episode — goes through one queue (`post`,
`take_back`), each with the key its episode was spawned with. User code that ends the loop
itself, past every guard, is heard of at once (`EnvironmentLoopDied`), where the generating
thread would otherwise wait forever for the episodes in flight.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, Generic, TypeVar

from asyncrl.environments.base import Environment, contained, describe

K = TypeVar("K")
log = logging.getLogger(__name__)

_CLOSE_TIMEOUT_S = 10.0
_REVIVALS = 100
"""Runs of a dead event loop `close` tries before it gives up on its environments."""


class EnvironmentLoopDied(RuntimeError):
    """The event loop that runs the episodes ended by itself: user code got past what guards
    its calls (a task or callback it started raised SystemExit, it stopped the loop). Every
    episode in flight is lost with it, so the scheduler cannot go on."""


class Spawned:
    """An episode handed to the loop; its task exists once the loop has started it."""

    __slots__ = ("task",)

    def __init__(self) -> None:
        self.task: asyncio.Task[None] | None = None


class EnvironmentLoop(Generic[K]):
    """Episodes as tasks on one event loop thread, started on first use; every method but
    `close_env` (an episode's, on the loop) is called from the generating thread."""

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self.steps: set[asyncio.Task[None]] = set()  # the loop keeps only weak references
        """The episodes running."""
        self._closing: set[asyncio.Task[None]] = set()  # environments being closed
        self._returned: queue.SimpleQueue[tuple[K, object] | EnvironmentLoopDied] = (
            queue.SimpleQueue()
        )
        self._died: EnvironmentLoopDied | None = None
        self._stopping = False  # `close` ends the loop: its end is no death

    def spawn(self, key: K, episode: Coroutine[Any, Any, object]) -> Spawned:
        """Run `episode` on the loop; what it returns, or the Exception it raised, comes back
        with `key` (nothing when it was cancelled)."""
        handle = Spawned()
        self._event_loop().call_soon_threadsafe(self._start, handle, key, episode)
        return handle

    def cancel(self, handles: Sequence[Spawned], why: str) -> None:
        """Cancel these episodes (with `why` as the CancelledError's message)."""
        if handles:
            self._event_loop().call_soon_threadsafe(self._cancel, handles, why)

    def call_soon(self, callback: Callable[..., object], *args: object) -> None:
        """Run `callback(*args)` on the loop (from any thread)."""
        self._event_loop().call_soon_threadsafe(callback, *args)

    def post(self, key: K, value: object) -> None:
        """Hand `value` to the generating thread (from the loop: a turn, a score)."""
        self._returned.put((key, value))

    def close_env(self, env: Environment) -> None:
        """On the loop: close `env` on a task of its own, which `close` waits for."""
        self._track(self._close(env), self._closing)

    def take_back(self, wait_s: float) -> list[tuple[K, object]]:
        """What was handed back so far, waiting up to `wait_s` for a first one;
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
        return returned

    def close(self) -> None:
        """Cancel the episodes in flight (their environments close: a session on an
        env-server is deleted), best effort within a few seconds, and end the loop thread."""
        if self._loop is None:
            return
        assert self._thread is not None
        if self._thread.is_alive():
            cancelled = asyncio.run_coroutine_threadsafe(self._cancel_all(), self._loop)
            try:
                cancelled.result(timeout=_CLOSE_TIMEOUT_S)
            except TimeoutError:
                log.warning("episodes ignored cancellation for %.0fs", _CLOSE_TIMEOUT_S)
        else:
            self._close_on_dead_loop()
        self._stopping = True
        self._loop.call_soon_threadsafe(self._loop.stop)
        if self._thread is not None:
            self._thread.join(_CLOSE_TIMEOUT_S)
        if not self._loop.is_running():
            self._loop.close()
        self._loop = self._thread = None

    def _close_on_dead_loop(self) -> None:
        """`close` after the loop's thread died: its tasks (the episodes, sessions to delete)
        are wound up on this thread instead, bounded as there."""
        loop = self._loop
        assert loop is not None
        wound_up = loop.create_task(asyncio.wait_for(self._cancel_all(), _CLOSE_TIMEOUT_S))
        # The code that ended the loop may have left more of the same in its queue: each run
        # past one goes on from the next callback.
        for _ in range(_REVIVALS):
            try:
                loop.run_until_complete(wound_up)
                return
            except BaseException as exc:
                last = exc
        log.warning("environments not closed after their event loop died: %s", describe(last))

    async def _cancel_all(self) -> None:
        await asyncio.sleep(0)  # episodes spawned but not started yet start (see `_cancel`)
        for task in self.steps:
            task.cancel()
        await asyncio.gather(*self.steps, return_exceptions=True)
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
        the episodes in flight."""
        try:
            loop.run_forever()
        except BaseException as exc:
            died = f"the environments' event loop died of {describe(exc)}"
        else:
            if self._stopping:
                return
            died = "the environments' event loop was stopped (by an environment's code)"
        self._returned.put(EnvironmentLoopDied(died))

    def _start(self, handle: Spawned, key: K, episode: Coroutine[Any, Any, object]) -> None:
        handle.task = self._track(self._run(key, episode), self.steps)

    def _cancel(self, handles: Sequence[Spawned], why: str) -> None:
        assert self._loop is not None
        for handle in handles:
            # A turn of the loop later: a task not started yet starts first, so that it enters
            # its `try` and releases what it holds (its environment) when the cancel lands.
            if handle.task is not None:
                self._loop.call_soon(handle.task.cancel, why)

    def _track(
        self, call: Coroutine[Any, Any, None], tasks: set[asyncio.Task[None]]
    ) -> asyncio.Task[None]:
        assert self._loop is not None
        task = self._loop.create_task(call)
        tasks.add(task)
        task.add_done_callback(tasks.discard)
        return task

    async def _run(self, key: K, episode: Coroutine[Any, Any, object]) -> None:
        try:
            result = await contained(episode)
        except asyncio.CancelledError:
            raise  # given up (its group failed, the loop closing): nothing to hand back
        except Exception as exc:
            result = exc
        self._returned.put((key, result))

    @staticmethod
    async def _close(env: Environment) -> None:
        try:
            await contained(env.close())
        except Exception:  # the episode is over: nothing to fail any more
            log.warning("closing an environment failed", exc_info=True)
