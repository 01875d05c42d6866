"""What every episode speaks in, whatever its kind and wherever it runs.

An episode is one `async` function on the environments' event loop that sees the rollout side
only through `Turns`: it awaits each turn's generation, and the task's score where nothing else
gives its reward. It need not know how or where generation runs (one engine call batching the
turns of every ready episode on the generating thread, `asyncrl.rollout.turns`, or anything
else that answers the same two calls), so no episode imports an engine. It returns its samples
or raises `EpisodeFailed`, which fails its whole group: one result per group.

The kinds side by side (docs/architecture.md, "An episode, top to bottom"):

    one turn      prompt → generate → score                     (inline, `rollout.scheduler`)
    environment   reset → (generate → step → render)* → score   (`episodes.environment`)
    agent         open a session → run → (call → budget → generate)* → samples
                                                                (`agents.episode`)
"""

from __future__ import annotations

from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any, Protocol

from asyncrl.reasons import GroupReason

if TYPE_CHECKING:
    from asyncrl.engines.base import Generation
    from asyncrl.engines.config import SamplingParams
    from asyncrl.items import PromptItem
    from asyncrl.protocol import Sample


class EpisodeFailed(Exception):
    """An episode that ends its group: `reason` is a `GroupReason` value (`engine_{reason}`,
    `env_{reason}`, `reward_*`, `agent_*`, ...), `detail` the words for its dead letter."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


class Turns(Protocol):
    """One episode's view of the side that runs it."""

    sampling: SamplingParams
    """The run's sampling: a turn's `max_new_tokens` at most."""
    max_context: int | None
    """Positions a turn may fill, its context and `max_new_tokens` together; None: no bound."""

    async def generate(
        self, context: list[int], params: SamplingParams | None = None
    ) -> Generation:
        """The turn after `context` (under `params`, default the run's sampling; `context` is
        not changed until it returns); `EpisodeFailed` when the engine gave none."""
        ...

    async def score(self, text: str) -> float:
        """The task's reward of the episode's last answer; `EpisodeFailed` when its code fails
        (the group has failed already)."""
        ...


class EpisodeKind(Protocol):
    """The episodes of one task: how each runs and what a finished group becomes."""

    def episode(
        self, turns: Turns, item: PromptItem, episode_id: str
    ) -> Coroutine[Any, Any, list[Sample]]:
        """Episode `episode_id` of `item`, to run on the environments' loop: its samples.
        Called when its group starts; what it raises then (the task's code cannot begin the
        episode) fails the group at once, as `task_error`."""
        ...

    def group(self, item: PromptItem, samples: list[Sample]) -> tuple[PromptItem, list[Sample]]:
        """The group as published, from its episodes' samples in order (`EpisodeFailed`: it
        cannot be)."""
        ...

    def close(self) -> None:
        """The scheduler is closing: release what the episodes share (a gateway, a runner),
        first, while the loop still runs."""
        ...


def too_long(tokens: int, max_new_tokens: int, max_context: int | None) -> EpisodeFailed:
    """A first turn the context bound has no room for: nothing generated, nothing to keep."""
    return EpisodeFailed(
        GroupReason.CONTEXT_TOO_LONG,
        f"{tokens} tokens of prompt and first observation and {max_new_tokens} new ones pass "
        f"the {max_context} positions",
    )


def fits(turns: Turns, tokens: int) -> bool:
    """Whether a turn after `tokens` of context stays within `turns.max_context`."""
    limit = turns.max_context
    return limit is None or tokens + turns.sampling.max_new_tokens <= limit
