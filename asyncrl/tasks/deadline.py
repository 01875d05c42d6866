"""Time bounds for scoring code that runs on the caller's thread (math-verify, sympy).

`call_with_deadline(seconds, fn, *args)` runs `fn(*args)` on the calling thread and raises
TimeoutError inside it once `seconds` have passed, then again every `_REFIRE_S` while it still
runs: code that swallows the first (sympy has broad `except`s) must not compute on. As with a
SIGALRM handler, the exception lands between two bytecodes: pure Python is interrupted, one
long C call is not. Unlike SIGALRM it works on any thread, so a reward scored on an
environment's event loop thread is bounded too.

One watchdog thread serves every call. It raises only while that very call of `fn` is on its
thread's stack, checked under the lock that the call's end takes too: the exception never lands
in the caller's code after the call (at worst at the call's very end, as a TimeoutError out of
`call_with_deadline`).
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import CodeType, FrameType
from typing import Any, TypeVar

T = TypeVar("T")

_REFIRE_S = 0.05


def call_with_deadline(seconds: float, fn: Callable[..., T], *args: Any) -> T:
    """`fn(*args)`, or TimeoutError once `seconds` have passed (see the module docstring);
    `fn` must be a Python function (its code object is how the watchdog finds the call)."""
    return _WATCHDOG.call(seconds, fn, *args)


@dataclass
class _Call:
    thread: int
    frame: FrameType
    code: CodeType
    due: float
    fired: bool = False


class _Watchdog:
    """One daemon thread that raises TimeoutError into the calls past their deadline."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._calls: dict[int, _Call] = {}
        self._watchdog: threading.Thread | None = None

    def call(self, seconds: float, fn: Callable[..., T], *args: Any) -> T:
        me = _Call(threading.get_ident(), sys._getframe(), fn.__code__, time.monotonic() + seconds)
        with self._cond:
            if self._watchdog is None:
                self._watchdog = threading.Thread(target=self._watch, name="deadlines", daemon=True)
                self._watchdog.start()
            if all(me.due < c.due for c in self._calls.values()):
                self._cond.notify()  # the watchdog sleeps until the earliest deadline
            self._calls[id(me)] = me
        try:
            return fn(*args)
        finally:
            with self._cond:
                self._calls.pop(id(me), None)  # the watchdog drops it if this end was cut short
                if me.fired:  # raised but maybe not landed yet: it must not land later
                    _set_async_exc(me.thread, None)

    def _watch(self) -> None:
        with self._cond:
            while True:
                now = time.monotonic()
                for key, c in list(self._calls.items()):
                    if c.due > now:
                        continue
                    if _running(c):
                        c.fired = True
                        _set_async_exc(c.thread, TimeoutError)
                    elif c.fired:  # out of `fn`: over, or its end was cut short by the raise
                        del self._calls[key]
                        continue
                    c.due = now + _REFIRE_S  # not in `fn` yet, or again in a moment
                due = min((c.due for c in self._calls.values()), default=None)
                self._cond.wait(None if due is None else max(due - now, 0.001))


def _running(call: _Call) -> bool:
    """Whether `call`'s function runs on its thread now, called from the `call` frame."""
    frame = sys._current_frames().get(call.thread)
    while frame is not None:
        if frame.f_code is call.code and frame.f_back is call.frame:
            return True
        frame = frame.f_back
    return False


_WATCHDOG = _Watchdog()


def _set_async_exc(thread: int, exc: type[BaseException] | None) -> None:
    import ctypes

    exc_object = None if exc is None else ctypes.py_object(exc)
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread), exc_object)
