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
import math
import zlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, overload

import numpy as np

from asyncrl.rollout.config import AgenticTaskConfig, ArithmeticTaskConfig
from asyncrl.rollout.rewards import RewardFn, build_reward
from asyncrl.rollout.tasks import ArithmeticTask, PromptItem

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
        low = 0 if cfg.digits == 1 else 10 ** (cfg.digits - 1)
        pairs = (10**cfg.digits - low) ** 2
        if cfg.eval_size * cfg.turns >= pairs:
            raise ValueError(
                f"task.eval_size={cfg.eval_size} × task.turns={cfg.turns} questions leave no "
                f"train questions: {cfg.digits}-digit operands make {pairs} pairs"
            )
        self._cfg = cfg
        self._tokenizer = tokenizer
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
        return _Episodes(self._questions.train_items(seed, epoch), self._cfg.turns)

    def eval_items(self) -> Sequence[PromptItem]:
        return _Episodes(self._questions.eval_items(), self._cfg.turns)

    def score(self, item: PromptItem, response_text: str) -> float:
        """A single response scored against the first question: what held-out evaluation,
        which generates one turn, measures."""
        return self._reward(response_text, item.answer.split(_SEP)[0].partition("=")[2])

    def environment(self, item: PromptItem, episode_id: str) -> ArithmeticToolEnvironment:
        rng = np.random.default_rng([self._cfg.latency_seed, zlib.crc32(episode_id.encode())])
        latency = LogNormalLatency(
            self._cfg.tool_latency_median_s, self._cfg.tool_latency_sigma, rng
        )
        script = [tuple(q.split("=", 1)) for q in item.answer.split(_SEP)]
        return ArithmeticToolEnvironment(
            [(f"{q}=", a) for q, a in script], self._tokenizer, self._reward, latency
        )


class _Episodes(Sequence[PromptItem]):
    """Consecutive runs of `turns` questions as episode items; a partial run at the end is
    left out."""

    def __init__(self, questions: Sequence[PromptItem], turns: int) -> None:
        self._questions = questions
        self._turns = turns

    def __len__(self) -> int:
        return len(self._questions) // self._turns

    @overload
    def __getitem__(self, index: int) -> PromptItem: ...
    @overload
    def __getitem__(self, index: slice) -> list[PromptItem]: ...
    def __getitem__(self, index: int | slice) -> PromptItem | list[PromptItem]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        if not -len(self) <= index < len(self):
            raise IndexError(index)
        start = (index % len(self)) * self._turns
        qs = self._questions[start : start + self._turns]
        return PromptItem(
            prompt_id=_SEP.join(q.prompt_id for q in qs),
            prompt=qs[0].prompt,
            prompt_ids=qs[0].prompt_ids,
            answer=_SEP.join(f"{q.prompt}{q.answer}" for q in qs),
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
    """One episode: checks each answer and, after the tool's latency, poses the next question.

    The wait is a real timer, standing for a tool call the episode awaits.
    """

    def __init__(
        self,
        script: list[tuple[str, str]],
        tokenizer: PreTrainedTokenizerBase,
        reward: RewardFn,
        latency: LogNormalLatency,
    ) -> None:
        self._script = script
        self._tokenizer = tokenizer
        self._reward = reward
        self._latency = latency
        self._turn = 0
        self._score = 0.0
        self.waited_s = 0.0
        """Seconds this episode spent in tool calls so far."""

    async def step(self, response_text: str) -> list[int] | None:
        if self._turn >= len(self._script):
            raise RuntimeError("step after the episode ended")
        wait = self._latency.draw()
        await asyncio.sleep(wait)
        self.waited_s += wait
        self._score += self._reward(response_text, self._script[self._turn][1])
        self._turn += 1
        if self._turn == len(self._script):
            return None
        ids: list[int] = self._tokenizer(self._script[self._turn][0])["input_ids"]
        return ids

    def reward(self) -> float:
        return self._score / len(self._script)
