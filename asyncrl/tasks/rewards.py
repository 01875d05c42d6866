"""Rewards: a response text and a reference answer in, a float out; chosen by config `type`."""

from __future__ import annotations

import re
import threading
from collections.abc import Callable
from fractions import Fraction
from functools import lru_cache
from typing import Any, assert_never

from asyncrl.tasks.config import ExactRewardConfig, MathRewardConfig, RewardConfig

RewardFn = Callable[[str, str], float]
"""(response_text, reference_answer) -> reward."""

_PLAIN_NUMBER = re.compile(r"[+-]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?")

MATH_VERIFY_TIMEOUT_S = 5
"""Bound of one math-verify parse or comparison on the main thread (math-verify's own alarm)."""


def exact_reward(response: str, reference: str) -> float:
    return 1.0 if response.strip() == reference.strip() else 0.0


def math_reward(response: str, reference: str) -> float:
    """1.0 when the response's final answer is mathematically equal to the reference's, else 0.0.

    The final answer is the text after the last `#### ` line (GSM8K) when there is one, else the
    whole text, which math-verify searches: the last `\\boxed{}` first, then LaTeX and plain
    expressions (the last number of a sentence). A reference without `####` is read as LaTeX
    (`x + 1`, `\\frac{1}{2}`). Plain numbers on both sides, the common case, are compared
    exactly without math-verify: the same verdict, a hundred times cheaper.

    math-verify bounds its work with SIGALRM, which only the main thread may set; elsewhere (an
    environment's thread) it runs unbounded, so a pathological expression can stall that thread.
    """
    answer = final_answer(response)
    want = final_answer(reference)
    got_n, want_n = _plain_number(answer), _plain_number(want)
    if got_n is not None and want_n is not None:
        return 1.0 if got_n == want_n else 0.0
    from math_verify import parse, verify

    timeout = (
        MATH_VERIFY_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None
    )
    gold = _parse_reference(want, timeout)
    if not gold:
        return 0.0
    target = parse(answer, parsing_timeout=timeout)
    return 1.0 if target and verify(gold, target, timeout_seconds=timeout) else 0.0


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
def _parse_reference(reference: str, timeout: int | None) -> list[Any]:
    """Parsed once per reference: a group's n responses are all scored against the same one."""
    from math_verify import parse

    latex = reference if "$" in reference or "\\boxed" in reference else f"${reference}$"
    return list(parse(latex, parsing_timeout=timeout))


def build_reward(cfg: RewardConfig) -> RewardFn:
    match cfg:
        case ExactRewardConfig():
            return exact_reward
        case MathRewardConfig():
            return math_reward
        case _:
            assert_never(cfg)
