import pytest

from asyncrl.tasks.config import ExactRewardConfig, MathRewardConfig
from asyncrl.tasks.rewards import (
    build_reward,
    exact_reward,
    extract_final_answer,
    math_reward,
    normalize_answer,
)


@pytest.mark.parametrize(
    ("text", "answer"),
    [
        ("so 6 * 7 = 42\n#### 42", "42"),
        ("#### 1\nwait, no\n#### 2\n", "2"),
        ("the answer is \\boxed{17}.", "17"),
        ("\\boxed{\\frac{1}{2}} is it", "\\frac{1}{2}"),
        ("first \\boxed{1}, finally \\boxed {\\text{x}^{2}}", "\\text{x}^{2}"),
        ("#### 5 then \\boxed{6}", "6"),
        ("\\boxed{6} then\n#### 5", "5"),
        ("no marker: 42", None),
        ("\\boxed{unclosed", None),
        ("\\boxed 7", None),
    ],
)
def test_extract_final_answer(text: str, answer: str | None) -> None:
    assert extract_final_answer(text) == answer


@pytest.mark.parametrize(
    ("raw", "normal"),
    [
        ("1,234,567", "1234567"),
        (" 42 ", "42"),
        ("3.0", "3"),
        ("2.50", "2.5"),
        ("$12$", "12"),
        ("+7.", "7"),
        ("\\frac{3}{4}", "3/4"),
        ("\\dfrac{3}{4}", "3/4"),
        ("3 / 4", "3/4"),
        ("5\\text{ apples}", "5apples"),
        ("1,2", "1,2"),
    ],
)
def test_normalize_answer(raw: str, normal: str) -> None:
    assert normalize_answer(raw) == normal


@pytest.mark.parametrize(
    ("response", "reference", "reward"),
    [
        ("#### 1,000", "1000", 1.0),
        ("\\boxed{1000.00}", "1000", 1.0),
        ("\\boxed{0.5}", "1/2", 1.0),
        ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}", 1.0),
        ("\\boxed{-3}", "-3", 1.0),
        ("#### 72", "Natalia sold 48/2 = 24 clips.\n#### 72", 1.0),
        ("#### 71", "72", 0.0),
        ("72", "72", 0.0),
        ("\\boxed{x+1}", "x + 1", 1.0),
        ("\\boxed{1/0}", "2", 0.0),
    ],
)
def test_math_reward(response: str, reference: str, reward: float) -> None:
    assert math_reward(response, reference) == reward


def test_exact_reward_and_factory() -> None:
    assert exact_reward(" 46\n", "46") == 1.0
    assert exact_reward("046", "46") == 0.0
    assert build_reward(ExactRewardConfig()) is exact_reward
    assert build_reward(MathRewardConfig()) is math_reward
