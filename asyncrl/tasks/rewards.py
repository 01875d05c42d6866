"""Rewards: a response text and a reference answer in, a float out; chosen by config `type`."""

from __future__ import annotations

import re
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction
from functools import lru_cache
from types import CodeType, FrameType
from typing import Any, assert_never

from asyncrl.tasks.config import ExactRewardConfig, MathRewardConfig, RewardConfig

RewardFn = Callable[[str, str], float]
"""(response_text, reference_answer) -> reward."""

_PLAIN_NUMBER = re.compile(r"[+-]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?")

MATH_VERIFY_TIMEOUT_S = 5
"""Bound of one math reward call that needs math-verify."""
_REFIRE_S = 0.05


def exact_reward(response: str, reference: str) -> float:
    return 1.0 if response.strip() == reference.strip() else 0.0


def math_reward(response: str, reference: str) -> float:
    """1.0 when the response's final answer is mathematically equal to the reference's, else 0.0.

    The final answer is the text after the last `#### ` line (GSM8K) when there is one, else the
    whole text, which math-verify searches: the last `\\boxed{}` first, then LaTeX and plain
    expressions (the last number of a sentence). A reference without `####` is read as LaTeX
    (`x + 1`, `\\frac{1}{2}`). Plain numbers on both sides, the common case, are compared
    exactly without math-verify: the same verdict, some fifty times cheaper.

    Each call is bounded by `MATH_VERIFY_TIMEOUT_S` (over it: 0.0, math-verify's own rule) by
    `_Deadlines`, on any thread. math-verify's own bound, SIGALRM, works on the main thread only
    (elsewhere it refuses to run with a timeout: an environment's event loop scores there), and
    fires once, which sympy can swallow in its broad `except`s and compute on for minutes.
    """
    answer = final_answer(response)
    want = final_answer(reference)
    got_n, want_n = _plain_number(answer), _plain_number(want)
    if got_n is not None and want_n is not None:
        return 1.0 if got_n == want_n else 0.0
    try:
        return _DEADLINES.call(MATH_VERIFY_TIMEOUT_S, _verify, answer, want)
    except TimeoutError:
        return 0.0


def _verify(answer: str, reference: str) -> float:
    from math_verify import parse, verify

    gold = _parse_reference(reference)
    if not gold:
        return 0.0
    target = parse(answer, parsing_timeout=None)
    return 1.0 if target and verify(gold, target, timeout_seconds=None) else 0.0


@dataclass
class _Call:
    thread: int
    frame: FrameType
    code: CodeType
    due: float
    fired: bool = False


class _Deadlines:
    """Runs functions on their calling threads and raises TimeoutError inside a call once its
    seconds have passed, then again every `_REFIRE_S` while it still runs (code that swallows
    the first must not compute on). As with SIGALRM's handler, the exception lands between two
    bytecodes: pure Python such as sympy's is interrupted, one long C call is not.

    One watchdog thread serves every call. It raises only while the very call is on its
    thread's stack, checked under the lock that the call's end takes too, so the exception
    never lands in the caller's code after the call (at worst at the call's very end, as a
    TimeoutError out of `call`)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._calls: dict[int, _Call] = {}
        self._watchdog: threading.Thread | None = None

    def call(self, seconds: float, fn: Callable[[str, str], float], *args: str) -> float:
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
                del self._calls[id(me)]
                if me.fired:  # raised but maybe not landed yet: it must not land later
                    _set_async_exc(me.thread, None)

    def _watch(self) -> None:
        with self._cond:
            while True:
                now = time.monotonic()
                for c in self._calls.values():
                    if c.due <= now and _running(c):
                        c.fired = True
                        _set_async_exc(c.thread, TimeoutError)
                        c.due = now + _REFIRE_S
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


_DEADLINES = _Deadlines()


def _set_async_exc(thread: int, exc: type[BaseException] | None) -> None:
    import ctypes

    exc_object = None if exc is None else ctypes.py_object(exc)
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread), exc_object)


def final_answer(text: str) -> str:
    """The rest of the line after the last `####` marker (GSM8K's answer line), else the whole
    text; stripped."""
    at = text.rfind("####")
    if at < 0:
        return text.strip()
    return text[at + 4 :].lstrip().partition("\n")[0].strip()


def _plain_number(text: str) -> int | Fraction | None:
    if not _PLAIN_NUMBER.fullmatch(text):
        return None
    digits = text.replace(",", "")
    return Fraction(digits) if "." in digits else int(digits)


@lru_cache(maxsize=4096)
def _parse_reference(reference: str) -> list[Any]:
    """Parsed once per reference: a group's n responses are all scored against the same one."""
    from math_verify import parse

    latex = reference if "$" in reference or "\\boxed" in reference else f"${reference}$"
    return list(parse(latex, parsing_timeout=None))


def build_reward(cfg: RewardConfig) -> RewardFn:
    match cfg:
        case ExactRewardConfig():
            return exact_reward
        case MathRewardConfig():
            return math_reward
        case _:
            assert_never(cfg)
