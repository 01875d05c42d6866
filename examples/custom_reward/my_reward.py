"""A reward of your own, loaded by import path (`task.reward.type: python`).

asyncrl calls `score(response, answer, **kwargs)` once per sampled response, in a child process
of its own, and trains on the float it returns. Here: full reward for the exact sum, partial
credit for a response of the right length, so the policy is pulled towards well-formed answers
before it gets them right.
"""

from typing import Any


def score(response: str, answer: Any, *, partial_credit: float = 0.0) -> float:
    """`response`: the decoded response (special tokens removed); `answer`: the item's
    reference answer as the task gives it (the arithmetic task: the sum as a string)."""
    guess, want = response.strip(), str(answer)
    if guess == want:
        return 1.0
    return partial_credit if len(guess) == len(want) and guess.isdigit() else 0.0
