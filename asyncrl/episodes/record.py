"""An episode's token record: its turns and the observations between them, as they become its
sample.

The response of a multi-turn sample holds every turn in order. Generated tokens keep the
behaviour log-prob and policy version the engine recorded, so a weight swap between turns shows
as a version step; observation tokens get loss mask 0, log-prob 0 and the version of the token
before them (the first observation, which comes before any token, the first turn's), so
versions stay non-decreasing and the trainer does not learn to predict them.

Worked example (a 2-turn episode, weights v3 → v4 swapped while the tool ran):

    tokens    4  6  <eos> | <bos> 5  6  +  7  8  = | 1  3  4  <eos>
    versions  3  3  3     | 3     3  3  3  3  3  3 | 4  4  4  4
    loss_mask 1  1  1     | 0     0  0  0  0  0  0 | 1  1  1  1

A record is its `Turn`s, each complete once its observation is in: what a journal of completed
turns would hold, and what an episode resumed elsewhere would start from.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from asyncrl.engines.base import Generation
from asyncrl.protocol import Sample
from asyncrl.protocol.records import MetaValue


@dataclass
class Turn:
    """One generated turn, then the observation the environment answered it with."""

    ids: np.ndarray
    """int32, as sampled (the stop token it ended on included)."""
    logprobs: np.ndarray
    versions: np.ndarray
    finish: str
    routed: np.ndarray | None
    """Its routed experts: its prompt is the whole context, so they cover every token before
    it too (earlier turns' tokens as this turn's prefill routed them)."""
    observation: list[int] = field(default_factory=list)
    """What joined the context after it, loss-masked; empty until the environment answers."""


class TokenRecord:
    """The tokens of one episode: the prompt's, an observation before the first turn (an
    environment's `reset`), then turns and their observations."""

    def __init__(self, prompt_ids: list[int]) -> None:
        self.prompt_len = len(prompt_ids)
        self.context = list(prompt_ids)
        """Every token so far: what the next turn is generated after."""
        self.first_observation: list[int] = []
        self.turns: list[Turn] = []
        self.finish = "length"
        """The last turn's finish; `length` too for an episode the context bound ended."""

    @property
    def ended_by(self) -> int | None:
        """The token that ended the last turn (an end of turn), None when the token limit cut
        it: what a chat observation's rendering goes on from."""
        last = self.turns[-1] if self.turns else None
        if last is None or last.finish != "stop" or not len(last.ids):
            return None
        return int(last.ids[-1])

    def add_turn(self, gen: Generation) -> None:
        self.turns.append(
            Turn(gen.token_ids, gen.logprobs, gen.versions, gen.finish, gen.routed_experts)
        )
        self.context.extend(gen.token_ids.tolist())
        self.finish = gen.finish

    def observe(self, ids: list[int]) -> None:
        """`ids` join the context: after the last turn, or before the first."""
        self.context.extend(ids)
        if self.turns:
            self.turns[-1].observation.extend(ids)
        else:
            self.first_observation.extend(ids)

    def sample(self, reward: float, meta: dict[str, MetaValue]) -> Sample:
        ids, logprobs, versions, mask = [], [], [], []

        def masked(tokens: list[int], version: int) -> None:
            n = len(tokens)
            ids.append(np.asarray(tokens, np.int32))
            logprobs.append(np.zeros(n, np.float32))
            versions.append(np.full(n, version, np.int32))
            mask.append(np.zeros(n, np.uint8))

        if self.first_observation:
            first = self.turns[0].versions if self.turns else np.zeros(0, np.int32)
            masked(self.first_observation, int(first[0]) if len(first) else 0)
        last = 0
        for turn in self.turns:
            ids.append(turn.ids)
            logprobs.append(turn.logprobs)
            versions.append(turn.versions)
            mask.append(np.ones(len(turn.ids), np.uint8))
            last = int(turn.versions[-1]) if len(turn.versions) else last
            if turn.observation:
                masked(turn.observation, last)
        loss_mask = np.concatenate(mask)
        response = np.concatenate(ids).astype(np.int32)
        routed = self.turns[-1].routed if self.turns else None
        if routed is not None and len(routed) != self.prompt_len + len(response) - 1:
            routed = None  # tokens joined after the last turn (a final observation): not routed
        return Sample(
            response_ids=response,
            logprobs=np.concatenate(logprobs).astype(np.float32),
            versions=np.concatenate(versions).astype(np.int32),
            reward=float(reward),
            finish="stop" if self.finish == "stop" else "length",
            meta=meta,
            # One-turn samples keep the wire as it was: no mask means every token is trained on.
            loss_mask=None if loss_mask.all() else loss_mask,
            routed_experts=routed,
        )


def one_turn_sample(prompt_len: int, gen: Generation, reward: float) -> Sample:
    """The sample of a one-turn episode: `TokenRecord`'s of one turn, without the record."""
    routed = gen.routed_experts
    if routed is not None and len(routed) != prompt_len + len(gen.token_ids) - 1:
        routed = None
    return Sample(
        response_ids=gen.token_ids.astype(np.int32),
        logprobs=gen.logprobs.astype(np.float32),
        versions=gen.versions.astype(np.int32),
        reward=float(reward),
        finish="stop" if gen.finish == "stop" else "length",
        meta={},
        loss_mask=None,
        routed_experts=routed,
    )
