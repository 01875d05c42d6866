import pytest

from asyncrl.tasks.config import ExactRewardConfig, MathRewardConfig
from asyncrl.tasks.rewards import build_reward, exact_reward, final_answer, math_reward


@pytest.mark.parametrize(
    ("text", "answer"),
    [
        ("so 6 * 7 = 42\n#### 42", "42"),
        ("#### 1\nwait, no\n#### 2\n", "2"),
        ("\\boxed{6} then\n#### 5", "5"),
        ("no marker: 42", "no marker: 42"),
    ],
)
def test_final_answer_is_after_the_last_hashes(text: str, answer: str) -> None:
    assert final_answer(text) == answer


@pytest.mark.parametrize(
    ("response", "reference", "reward"),
    [
        # GSM8K answer lines, on either side
        ("#### 1,000", "1000", 1.0),
        ("#### 72", "Natalia sold 48/2 = 24 clips.\n#### 72", 1.0),
        ("#### 71", "72", 0.0),
        ("\\boxed{6} then\n#### 5", "5", 1.0),
        ("#### 5 then \\boxed{6}", "6", 1.0),
        # \boxed{}, nested braces and LaTeX
        ("the answer is \\boxed{17}.", "17", 1.0),
        ("\\boxed{1000.00}", "1000", 1.0),
        ("\\boxed{0.5}", "1/2", 1.0),
        ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}", 1.0),
        ("\\boxed{\\dfrac{3}{4}}", "0.75", 1.0),
        ("$\\frac{3}{4}$", "3 / 4", 1.0),
        ("\\boxed{-3}", "-3", 1.0),
        ("\\boxed{x+1}", "x + 1", 1.0),
        ("\\boxed{x+1}", "x + 2", 0.0),
        ("\\boxed{1/0}", "2", 0.0),
        ("\\boxed{unclosed", "5", 0.0),
        # equal as numbers, whatever the spelling
        ("#### 1,234,567", "1234567", 1.0),
        ("#### 3.0", "3", 1.0),
        ("#### 2.50", "2.5", 1.0),
        ("#### +7", "7", 1.0),
        ("#### $12$", "12", 1.0),
        ("#### 1,2", "12", 0.0),  # not a thousands separator
        # math-verify reads an unmarked response too: its last number
        ("72", "72", 1.0),
        ("so 6 * 7 = 42", "42", 1.0),
        ("no answer here", "5", 0.0),
        ("", "5", 0.0),
        # math-verify's rule: several boxed answers are one set
        ("first \\boxed{1}, finally \\boxed{2}", "2", 0.0),
    ],
)
def test_math_reward(response: str, reference: str, reward: float) -> None:
    assert math_reward(response, reference) == reward


def test_exact_reward_and_factory() -> None:
    assert exact_reward(" 46\n", "46") == 1.0
    assert exact_reward("046", "46") == 0.0
    assert build_reward(ExactRewardConfig()) is exact_reward
    assert build_reward(MathRewardConfig()) is math_reward
