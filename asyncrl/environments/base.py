"""The `Environment` protocol: what one multi-turn episode talks to between the policy's turns."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from asyncrl.tasks.base import PromptItem


@dataclass(frozen=True)
class StepResult:
    """What an environment answers to one turn of the policy."""

    observation: str | list[dict[str, str]] | None
    """Text appended as tokens, or chat messages ({"role", "content"}) rendered with the
    tokenizer's chat template (generation prompt added); None: nothing to append."""

    done: bool
    """The episode is over; no further turn is generated."""

    reward: float | None = None
    """The episode's reward when done; None: scored by the task's reward."""

    info: dict[str, Any] = field(default_factory=dict)
    """Anything the environment reports about the step (counts, timings), for logs and metrics."""


class Environment(Protocol):
    """One episode's environment; all methods are coroutines, so a tool awaits its I/O."""

    async def reset(self, item: PromptItem) -> str | list[dict[str, str]] | None:
        """Start the episode of `item`; the first observation (None: the item's own prompt)."""
        ...

    async def step(self, response: str) -> StepResult:
        """Take the policy's turn (special tokens removed)."""
        ...

    async def close(self) -> None:
        """Release what the episode holds; called once, also after a failure."""
        ...
