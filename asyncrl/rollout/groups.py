"""A group in flight (`Group`: the n episodes of one prompt) and what it ends as: a
`FinishedGroup` or a `FailedGroup`, handed back by the scheduler (`asyncrl.rollout.scheduler`)
exactly once."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Generic, TypeVar

import numpy as np

from asyncrl.items import PromptItem
from asyncrl.protocol import Sample
from asyncrl.rollout.env_loop import Spawned

T = TypeVar("T")

STALE = "stale"
"""The `FailedGroup.reason` of a group `drop_older_than` gave up: no failure, dropped not
dead-lettered."""


@dataclass
class FinishedGroup(Generic[T]):
    """All n episodes of a prompt, ended."""

    tag: T
    """What the caller started the group with (the worker: its stream delivery)."""
    item: PromptItem
    samples: list[Sample]
    """One per episode, in episode order (an agent's: one per transcript segment)."""
    created_at: float
    """Unix seconds when the group's episodes started."""


@dataclass
class FailedGroup(Generic[T]):
    """A group given up: an episode of it failed, or it fell too far behind."""

    tag: T
    reason: str
    """Short stable code, a `GroupReason` value (`engine_{reason}` of an EngineError,
    `env_{reason}` of an EnvironmentFailure, `reward_*` of a RewardFailure, `agent_*`, ...);
    `STALE` for a group `drop_older_than` gave up (the trainer would drop it)."""
    detail: str


@dataclass(eq=False)
class Group(Generic[T]):
    tag: T
    item: PromptItem
    samples: list[list[Sample] | None]
    """Each episode's samples once it ended."""
    created_at: float
    failed: bool = False
    oldest: int | None = None
    """The version of its oldest generated token (None before the first)."""
    episodes: list[Spawned] = field(default_factory=list)
    running: int = 0
    """Its episodes on the loop that have not ended."""

    def saw(self, versions: np.ndarray) -> None:
        if len(versions):
            first = int(versions[0])
            self.oldest = first if self.oldest is None else min(self.oldest, first)

    @property
    def done(self) -> bool:
        return all(s is not None for s in self.samples)
