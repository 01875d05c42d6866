"""A task of your own, loaded by import path (`task.type: python`), with an async reward.

`make(**kwargs)` returns the records of each split; asyncrl validates them like dataset rows,
tokenises the prompts and scores responses with `task.reward`. Answers need not be strings:
here each is an int, handed to `score` as it is. (A factory may instead return a whole `Task`
object — `train_items`, `eval_items`, `score`, see `asyncrl/tasks/base.py` — to control
splits, ids and scoring itself; give the factory a `tokenizer` parameter to get the run's.)
"""

import asyncio
import random
from collections.abc import Iterator
from typing import Any


def make(*, low: int = 10, high: int = 99, eval_size: int = 200, seed: int = 0) -> dict[str, Any]:
    """Sums `a+b=` of operands in [low, high]; the held-out pairs never appear in train."""
    pairs = [(a, b) for a in range(low, high + 1) for b in range(low, high + 1)]
    random.Random(seed).shuffle(pairs)
    return {"eval": _records(pairs[:eval_size]), "train": _records(pairs[eval_size:])}


def _records(pairs: list[tuple[int, int]]) -> Iterator[dict[str, Any]]:
    for a, b in pairs:
        yield {"prompt": f"{a}+{b}=", "answer": a + b}


async def score(response: str, answer: int) -> float:
    """An async reward: a real one might await a judge or a sandbox here."""
    await asyncio.sleep(0)
    return 1.0 if response.strip() == str(answer) else 0.0
