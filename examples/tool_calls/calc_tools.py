"""Tools for a multi-turn episode (`task.environment.type: tools`), and the task that needs them.

Each tool is a plain function: its name, type hints and docstring (`Args:`) become the JSON
schema the model is shown through the chat template's `tools=`. Sync tools run on a thread;
`async def` ones (like `lookup_rate`, standing for an HTTP call) are awaited, so one slow
tool holds no thread. The model calls them as

    <tool_call>
    {"name": "multiply", "arguments": {"a": 17, "b": 23}}
    </tool_call>

and answers with a bare number once it is done; `task.reward` scores that answer.
"""

import asyncio
import random
from collections.abc import Iterator
from typing import Any

RATES = {"EUR": 1.08, "GBP": 1.27, "JPY": 0.0067}


def add(a: float, b: float) -> float:
    """Add two numbers.

    Args:
        a: The first addend.
        b: The second addend.
    """
    return a + b


def multiply(a: float, b: float) -> float:
    """Multiply two numbers.

    Args:
        a: The first factor.
        b: The second factor.
    """
    return a * b


async def lookup_rate(currency: str) -> float:
    """The exchange rate of a currency to US dollars.

    Args:
        currency: An ISO 4217 code: EUR, GBP or JPY.
    """
    await asyncio.sleep(0.05)  # a real tool awaits a service here
    return RATES[currency]  # an unknown code raises: the model reads the error and retries


def make(*, eval_size: int = 100, seed: int = 0) -> dict[str, Any]:
    """Questions that take two or three calls: convert an amount, then add a fee."""
    rng = random.Random(seed)
    items = [
        (rng.randint(10, 999), rng.choice(sorted(RATES)), rng.randint(1, 20)) for _ in range(2000)
    ]
    return {"eval": _records(items[:eval_size]), "train": _records(items[eval_size:])}


def _records(items: list[tuple[int, str, int]]) -> Iterator[dict[str, Any]]:
    for amount, currency, fee in items:
        question = (
            f"How many US dollars are {amount} {currency} plus a fee of {fee} dollars? "
            "Use the tools, then answer with the number alone, rounded to 2 decimals."
        )
        yield {"prompt": question, "answer": f"{amount * RATES[currency] + fee:.2f}"}
