"""Rewards: a response text and a reference answer in, a float out; chosen by config `type`."""

import re
from collections.abc import Callable
from fractions import Fraction
from typing import Any, assert_never

from asyncrl.tasks.config import (
    ExactRewardConfig,
    MathRewardConfig,
    PythonRewardConfig,
    RewardConfig,
)

RewardFn = Callable[[str, Any], float]
"""(response_text, reference_answer) -> reward; the answer as the task gives it."""

_HASHES = re.compile(r"####\s*([^\n]*)")
_FRAC = re.compile(r"\\d?frac\{([^{}]*)\}\{([^{}]*)\}")
_TEXT = re.compile(r"\\(?:text|mathrm)\{([^{}]*)\}")
_THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}\b)")


def exact_reward(response: str, reference: Any) -> float:
    """1.0 when the stripped response equals the reference (a non-string one as its `str`)."""
    return 1.0 if response.strip() == str(reference).strip() else 0.0


def math_reward(response: str, reference: Any) -> float:
    """1.0 when the response's final answer equals the reference's, else 0.0.

    The response must mark its answer (`#### x` or `\\boxed{x}`); a reference without a marker
    is taken whole, a non-string one as its `str` (a dataset's number, say). Equal after
    normalisation, or equal as numbers ("1/2" and "0.5" agree).
    """
    reference = str(reference)
    answer = extract_final_answer(response)
    if answer is None:
        return 0.0
    ref = extract_final_answer(reference)
    got, want = normalize_answer(answer), normalize_answer(reference if ref is None else ref)
    if got == want:
        return 1.0
    got_n, want_n = _as_number(got), _as_number(want)
    return 1.0 if got_n is not None and got_n == want_n else 0.0


def extract_final_answer(text: str) -> str | None:
    """The content of the last `\\boxed{...}` (nested braces allowed) or `#### ...` line,
    whichever comes later; None when there is neither."""
    boxed_at = text.rfind("\\boxed")
    hashes = list(_HASHES.finditer(text))
    if hashes and hashes[-1].start() > boxed_at:
        return hashes[-1].group(1)
    if boxed_at < 0:
        return None
    return _leading_group(text[boxed_at + len("\\boxed") :].lstrip())


def _leading_group(text: str) -> str | None:
    """The inside of the brace group `text` starts with; None if none or it never closes."""
    if not text.startswith("{"):
        return None
    depth = 0
    for i, char in enumerate(text):
        depth += {"{": 1, "}": -1}.get(char, 0)
        if depth == 0:
            return text[1:i]
    return None


def normalize_answer(answer: str) -> str:
    """Canonical text of an answer: no spaces, `$`, thousands commas, `\\text{}` or trailing
    zeros after a decimal point; `\\frac{a}{b}` becomes `a/b`."""
    s = _TEXT.sub(r"\1", answer)
    s = _FRAC.sub(r"\1/\2", s)
    s = s.replace("$", "").replace("\\!", "").replace("\\,", "")
    s = "".join(s.split()).rstrip(".")
    s = _THOUSANDS.sub("", s)
    s = s.removeprefix("+")
    if re.fullmatch(r"-?\d+\.\d*", s):
        s = s.rstrip("0").rstrip(".")
    return s


def _as_number(s: str) -> Fraction | None:
    try:
        return Fraction(s)
    except (ValueError, ZeroDivisionError):
        return None


def build_reward(cfg: RewardConfig) -> RewardFn:
    match cfg:
        case ExactRewardConfig():
            return exact_reward
        case MathRewardConfig():
            return math_reward
        case PythonRewardConfig():
            from asyncrl.tasks.plugins import IsolatedReward

            return IsolatedReward(cfg.path, cfg.python_path, cfg.kwargs, cfg.timeout_s)
        case _:
            assert_never(cfg)
