"""Rewards: a response text and a reference answer in, a float out; chosen by config `type`."""

from __future__ import annotations

import re
from collections.abc import Callable
from fractions import Fraction
from functools import lru_cache
from typing import Any, assert_never

from asyncrl.tasks.config import (
    ExactRewardConfig,
    MathRewardConfig,
    PythonRewardConfig,
    RewardConfig,
)
from asyncrl.tasks.deadline import call_with_deadline

RewardFn = Callable[[str, Any], float]
"""(response_text, reference_answer) -> reward; the answer as the task gives it."""

_PLAIN_NUMBER = re.compile(r"[+-]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?")

MATH_VERIFY_TIMEOUT_S = 5
"""Bound of one math reward call that needs math-verify."""


def exact_reward(response: str, reference: Any) -> float:
    """1.0 when the stripped response equals the reference (a non-string one as its `str`)."""
    return 1.0 if response.strip() == str(reference).strip() else 0.0


def math_reward(response: str, reference: Any) -> float:
    """1.0 when the response's final answer is mathematically equal to the reference's, else 0.0.

    The final answer is the text after the last `#### ` line (GSM8K) when there is one, else the
    whole text, which math-verify searches: the last `\\boxed{}` first, then LaTeX and plain
    expressions (the last number of a sentence). A reference without `####` is read as LaTeX
    (`x + 1`, `\\frac{1}{2}`). Plain numbers on both sides, the common case, are compared
    exactly without math-verify: the same verdict, some fifty times cheaper.

    Each call is bounded by `MATH_VERIFY_TIMEOUT_S` (over it: 0.0, math-verify's own rule) by
    `call_with_deadline`, on any thread. math-verify's own bound, SIGALRM, works on the main
    thread only (elsewhere it refuses to run with a timeout: an environment's event loop scores
    there), and fires once, which sympy can swallow in its broad `except`s and compute on for
    minutes (`tests/test_math_reward_threads.py`). A non-string reference (a dataset's number,
    say) is read as its `str`.
    """
    answer = final_answer(response)
    want = final_answer(str(reference))
    got_n, want_n = _plain_number(answer), _plain_number(want)
    if got_n is not None and want_n is not None:
        return 1.0 if got_n == want_n else 0.0
    try:
        return call_with_deadline(MATH_VERIFY_TIMEOUT_S, _verify, answer, want)
    except TimeoutError:
        return 0.0


def _verify(answer: str, reference: str) -> float:
    from math_verify import parse, verify

    gold = _parse_reference(reference)
    if not gold:
        return 0.0
    target = parse(answer, parsing_timeout=None)
    return 1.0 if target and verify(gold, target, timeout_seconds=None) else 0.0


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
        case PythonRewardConfig():
            from asyncrl.tasks.isolated import IsolatedReward

            return IsolatedReward(cfg.path, cfg.python_path, cfg.kwargs, cfg.timeout_s)
        case _:
            assert_never(cfg)
