"""A worked multi-turn environment: a calculator tool the policy calls between turns.

The item is an addition `a+b=`; the policy answers, the tool checks the answer and poses the
follow-up question `b+a=` (the same sum, commuted) once, then ends the episode with the mean
of the two turns' exact-match rewards. Run it in the rollout worker:

    task:
      type: arithmetic
      environment:
        {type: python, path: "calculator_env:Calculator", python_path: [examples/env_server]}

or out of process, behind `asyncrl env-server`:

    asyncrl env-server --env calculator_env:Calculator --python-path examples/env_server --port 8300
    task:
      type: arithmetic
      environment: {type: remote, urls: ["http://127.0.0.1:8300"]}

`prefix` is written before each observation: the quickstart's tiny tokenizer reads its prompts
after `<bos>`, so the follow-up question looks like one.
"""

from __future__ import annotations

import asyncio
from typing import Any

from asyncrl.environments import StepResult


class Calculator:
    def __init__(self, prefix: str = "<bos>", latency_s: float = 0.0) -> None:
        self._prefix = prefix
        self._latency_s = latency_s
        self._questions: list[tuple[str, str]] = []
        self._rewards: list[float] = []

    async def reset(self, item: Any) -> None:
        a, b = item.prompt.rstrip("=").split("+")
        total = str(int(a) + int(b))
        self._questions = [(f"{a}+{b}", total), (f"{b}+{a}", total)]
        return None  # the prompt is the first question

    async def step(self, response: str) -> StepResult:
        await asyncio.sleep(self._latency_s)  # the tool's I/O
        turn = len(self._rewards)
        self._rewards.append(1.0 if response.strip() == self._questions[turn][1] else 0.0)
        if len(self._rewards) == len(self._questions):
            return StepResult(None, done=True, reward=sum(self._rewards) / len(self._rewards))
        return StepResult(f"{self._prefix}{self._questions[turn + 1][0]}=", done=False)

    async def close(self) -> None:
        self._questions = []
