"""The math reward's time bound on and off the main thread: math-verify's SIGALRM timeout works
only on the main thread and refuses to run with one elsewhere, so other threads (an agentic
environment's event loop) get a deadline of their own."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest

from asyncrl.tasks import deadline, rewards
from asyncrl.tasks.deadline import call_with_deadline
from asyncrl.tasks.rewards import math_reward

# sympy takes ~25 s on 2 busy cores to tell these apart: an answer a policy could emit.
SLOW = ("\\boxed{(x+1)^{3000}}", "(x+2)^{3000}")


def on_a_thread(fn: Callable[[], object]) -> object:
    out: list[object] = []

    def run() -> None:
        try:
            out.append(fn())
        except BaseException as exc:  # what the test asserts against, not swallowed
            out.append(exc)

    worker = threading.Thread(target=run)
    worker.start()
    worker.join(60)
    assert not worker.is_alive()
    return out[0]


def test_scores_off_the_main_thread() -> None:
    assert on_a_thread(lambda: math_reward("\\boxed{\\frac{1}{2}}", "0.5")) == 1.0
    assert on_a_thread(lambda: math_reward("\\boxed{x}", "y")) == 0.0


@pytest.mark.parametrize("where", ["main", "thread"])
def test_a_slow_comparison_is_bounded_and_scores_zero(
    where: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(rewards, "MATH_VERIFY_TIMEOUT_S", 1)
    start = time.monotonic()
    score = math_reward(*SLOW) if where == "main" else on_a_thread(lambda: math_reward(*SLOW))
    assert score == 0.0
    assert time.monotonic() - start < 30  # cut at its 1 s deadline, not run to the end


def busy(ms: str, swallow: str) -> float:
    """Pure Python for `ms` milliseconds; with `swallow`, catching timeouts as sympy may."""
    end = time.perf_counter() + float(ms) / 1e3
    while time.perf_counter() < end:
        try:
            sum(range(100))
        except TimeoutError:
            if not swallow:
                raise
    return 1.0


def test_a_deadline_lands_inside_the_call_or_never() -> None:
    """Calls that end around their deadline: the timeout lands inside the call or not at all,
    never in the code after it (it would escape the thread here); a call that swallows it is
    interrupted again until it gives up."""

    def many() -> list[float]:
        scores = []
        for i in range(200):
            try:
                score = call_with_deadline(0.008, busy, str(2 + 3 * (i % 12)), "")
            except TimeoutError:
                score = -1.0  # interrupted in the call, caught as math_reward catches it
            scores.append(score)
            time.sleep(0.0005)  # a late exception would land here
        return scores

    scores = on_a_thread(many)
    assert isinstance(scores, list), scores
    assert scores.count(1.0) > 10 and scores.count(-1.0) > 10, scores
    time.sleep(0.2)
    assert not deadline._WATCHDOG._calls  # none left behind for the watchdog to wake for

    def swallowing() -> float:
        return call_with_deadline(0.01, busy, "60000", "swallow")

    start = time.monotonic()
    assert isinstance(on_a_thread(swallowing), TimeoutError)  # a later one landed outside `try`
    assert time.monotonic() - start < 30  # interrupted again and again, not run out
