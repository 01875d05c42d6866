"""An agentic-style workload on the arithmetic task: multi-turn episodes behind a slow tool.

An episode is `turns` addition questions. The prompt is the first question; each answer goes to
a tool that takes a log-normally distributed time, then returns the next question, which joins
the context as observation tokens. Episode times therefore differ by tens of times, which is
what a rollout pool must absorb without idling its engine or its trainer. The reward is
verifiable: the fraction of questions answered right. Worked example (2 digits, 2 turns):

    prompt   "<bos>12+34="
    turn 1   policy "46<eos>"              -> tool waits ~median, answer right
    observe  "<bos>56+78="                 (loss mask 0, log-prob 0)
    turn 2   policy "133<eos>"             -> tool waits, answer wrong (134): episode over
    reward   1/2 = 0.5

Each observation starts with the tokenizer's special prefix (`<bos>` for the tiny model), so
every question reads like the prompts the quickstart model was warmed on.
"""

from __future__ import annotations

import asyncio
import functools
import math
import zlib
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from asyncrl.environments.base import StepResult
from asyncrl.items import PromptItem
from asyncrl.tasks.base import ArithmeticTask, LazyItems
from asyncrl.tasks.config import AgenticTaskConfig, ArithmeticTaskConfig, ExactRewardConfig
from asyncrl.tasks.rewards import RewardFn, build_reward

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# Separates the questions of an episode in `PromptItem.prompt_id` and `.answer`.
_SEP = ";"


class AgenticTask:
    """Episodes of `turns` arithmetic questions, drawn from the arithmetic task's split.

    The arithmetic pair space is split once under `cfg.seed` (eval pairs first), and episode i
    of an epoch is questions i·turns … i·turns + turns − 1 of that epoch's permutation, so the
    eval and train splits never share a question. An item carries its whole episode script:
    `prompt_id` "12+34;56+78", `answer` "12+34=46;56+78=134"; the prompt is the first question.
    """

    def __init__(self, cfg: AgenticTaskConfig, tokenizer: PreTrainedTokenizerBase) -> None:
        self._cfg = cfg
        self._tokenizer = tokenizer
        # Observations are rendered without special tokens added, so the tool writes the
        # tokenizer's prefix (`<bos>`) itself: every question then reads like a prompt.
        self._prefix = str(tokenizer.decode(tokenizer("")["input_ids"]))
        self._reward = build_reward(cfg.reward)
        self._questions = ArithmeticTask(
            ArithmeticTaskConfig(
                digits=cfg.digits,
                eval_size=cfg.eval_size * cfg.turns,
                train_size=cfg.train_size * cfg.turns,
                seed=cfg.seed,
                reward=cfg.reward,
            ),
            tokenizer,
        )

    def train_items(self, seed: int, epoch: int) -> Sequence[PromptItem]:
        return self._episodes(self._questions.train_pairs(seed, epoch))

    def eval_items(self) -> Sequence[PromptItem]:
        return self._episodes(self._questions.eval_pairs())

    def _episodes(self, pairs: np.ndarray) -> Sequence[PromptItem]:
        """Consecutive runs of `turns` questions as episode items; a partial run at the end is
        left out."""
        return LazyItems(
            functools.partial(self._episode, pairs), np.arange(len(pairs) // self._cfg.turns)
        )

    def _episode(self, pairs: np.ndarray, index: int) -> PromptItem:
        # Only the first question is tokenised here: the others are rendered by the worker
        # that runs the episode, as the tool poses them.
        turns = self._cfg.turns
        questions = [
            self._questions.question(p) for p in pairs[index * turns : (index + 1) * turns]
        ]
        prompt = f"{questions[0][0]}="
        return PromptItem(
            prompt_id=_SEP.join(q for q, _ in questions),
            prompt=prompt,
            prompt_ids=self._tokenizer(prompt)["input_ids"],
            answer=_SEP.join(f"{q}={a}" for q, a in questions),
        )

    def score(self, item: PromptItem, response_text: str) -> float:
        """A single response scored against the first question: what held-out evaluation,
        which generates one turn, measures."""
        return self._reward(response_text, item.answer.split(_SEP)[0].partition("=")[2])

    def is_hard(self, item: PromptItem) -> bool:
        """Whether the episode's first sum has more digits than its operands ("56+78=134")."""
        first = str(item.answer).split(_SEP)[0]
        return len(first.partition("=")[2]) > self._cfg.digits

    def environment(self, item: PromptItem, episode_id: str) -> ArithmeticToolEnvironment:
        rng = np.random.default_rng([self._cfg.latency_seed, zlib.crc32(episode_id.encode())])
        factor = self._cfg.hard_tool_factor if self.is_hard(item) else 1.0
        return ArithmeticToolEnvironment(
            self._cfg.tool_latency_median_s * factor,
            self._cfg.tool_latency_sigma,
            observation_prefix=self._prefix,
            reward=self._reward,
            rng=rng,
        )


class LogNormalLatency:
    """Seconds of successive tool calls: exp(N(log median, σ²)); σ = 0 gives the median."""

    def __init__(self, median_s: float, sigma: float, rng: np.random.Generator) -> None:
        self._mu = math.log(median_s) if median_s > 0 else -math.inf
        self._sigma = sigma
        self._rng = rng

    def draw(self) -> float:
        if self._mu == -math.inf:
            return 0.0
        return float(math.exp(self._mu + self._sigma * self._rng.standard_normal()))


class ArithmeticToolEnvironment:
    """One episode (an `Environment`): checks each answer and, after the tool's latency, poses
    the next question of the item's script (`answer` "12+34=46;56+78=134").

    The wait is a real timer, standing for a tool call the episode awaits. Servable as it is:
    `asyncrl env-server --env asyncrl.tasks.agentic:ArithmeticToolEnvironment --kwargs
    '{"latency_median_s": 0.2, "latency_sigma": 1.0, "observation_prefix": "<bos>"}'` (scored
    by exact match there; in the worker by `task.reward`).
    """

    def __init__(
        self,
        latency_median_s: float = 0.0,
        latency_sigma: float = 0.0,
        observation_prefix: str = "",
        *,
        reward: RewardFn | None = None,
        rng: np.random.Generator | None = None,
    ) -> None:
        self._latency = LogNormalLatency(
            latency_median_s, latency_sigma, rng or np.random.default_rng()
        )
        self._prefix = observation_prefix
        self._reward = reward or build_reward(ExactRewardConfig())
        self._answers: list[str] = []
        self._questions: list[str] = []
        self._turn = 0
        self._score = 0.0
        self.waited_s = 0.0
        """Seconds this episode spent in tool calls so far."""

    async def reset(self, item: PromptItem) -> None:
        pairs = [q.split("=", 1) for q in str(item.answer).split(_SEP)]
        self._questions = [q for q, _ in pairs]
        self._answers = [a for _, a in pairs]

    async def step(self, response: str) -> StepResult:
        if self._turn >= len(self._answers):
            raise RuntimeError("step after the episode ended")
        wait = self._latency.draw()
        await asyncio.sleep(wait)
        self.waited_s += wait
        self._score += self._reward(response, self._answers[self._turn])
        self._turn += 1
        if self._turn == len(self._answers):
            return StepResult(None, done=True, reward=self._score / len(self._answers))
        return StepResult(f"{self._prefix}{self._questions[self._turn]}=", done=False)

    async def close(self) -> None:
        pass
