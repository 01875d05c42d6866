"""The scheduler tests' engine and loops: a `ScriptedEngine` that answers every prompt alike,
and the loops that advance an `EpisodeScheduler` until its groups finish or one fails."""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from asyncrl.engines.base import EngineError, Generation
from asyncrl.engines.config import SamplingParams
from asyncrl.rollout.groups import FailedGroup, FinishedGroup
from asyncrl.rollout.scheduler import EpisodeScheduler
from asyncrl.tiny_model import EOS_ID

PARAMS = SamplingParams(max_new_tokens=4)


def digit(d: int) -> int:
    return 3 + d  # the tiny vocabulary: <pad> <bos> <eos> 0..9 + =


PLUS, EQ = 13, 14


class ScriptedEngine:
    """Answers every prompt with `reply`, log-prob −0.5 per token, at `version`."""

    def __init__(self, reply: list[int]) -> None:
        self.reply = reply
        self.version = 0
        self.batches: list[int] = []
        self.fail_at: set[int] = set()
        """Prompt indices of the next call that fail (EngineError with partial results)."""

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        self.batches.append(len(prompts))
        n = len(self.reply)
        gens = [
            Generation(
                token_ids=np.array(self.reply, np.int32),
                logprobs=np.full(n, -0.5, np.float32),
                versions=np.full(n, self.version, np.int32),
                finish="stop",
            )
            for _ in prompts
        ]
        if self.fail_at:
            partial = [None if i in self.fail_at else g for i, g in enumerate(gens)]
            self.fail_at = set()
            raise EngineError("timeout", "scripted failure", partial)
        return gens


def answering_one(task: Any, tokenizer: Any) -> EpisodeScheduler[str]:
    """A scheduler over `task` whose engine answers "1" to every prompt."""
    return EpisodeScheduler(ScriptedEngine([digit(1), EOS_ID]), task, tokenizer, PARAMS)


def run_until_done(
    sched: EpisodeScheduler[str], groups: int, timeout_s: float = 30.0
) -> list[FinishedGroup[str]]:
    done: list[FinishedGroup[str]] = []
    deadline = time.monotonic() + timeout_s
    while len(done) < groups:
        assert time.monotonic() < deadline, "episodes did not finish"
        finished, failed = sched.advance(0.05)
        assert not failed
        done.extend(finished)
    return done


def run_until_failed(sched: EpisodeScheduler[str], timeout_s: float) -> list[FailedGroup[str]]:
    """The groups of the first `advance` that failed any; none may finish before."""
    failed: list[FailedGroup[str]] = []
    deadline = time.monotonic() + timeout_s
    while not failed:
        assert time.monotonic() < deadline
        finished, failed = sched.advance(0.05)
        assert not finished
    return failed
