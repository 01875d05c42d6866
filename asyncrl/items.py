"""The items tasks hand out and environments, engines' callers and the trainer's admission
pass around: a word every side shares, so it lives below all of them. Imports nothing of
asyncrl."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class PromptItem:
    """One prompt with its reference answer."""

    prompt_id: str
    """Stable id, unique within the task (same file or seed: same id)."""

    prompt: str
    """The prompt text as the task states it, before any chat template."""

    prompt_ids: list[int]
    """The token ids the engine conditions on (chat template and special tokens applied)."""

    answer: Any
    """Reference answer handed to the reward as the task gives it: a string, or a plain value
    (number, bool, list, string-keyed map of those) that travels on the wire unchanged."""

    messages: list[dict[str, str]] | None = None
    """The prompt as chat messages, where the task gave it so (a dataset row of messages;
    `prompt` is then the last one's content): what a tools environment renders its prompt
    from. Not sent to rollout workers, which get `prompt_ids`."""
