"""What an agent's episode ended with: its reward (returned, printed or POSTed to its session),
or its failure by reason. Imports nothing of the gateway, which all of it uses."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

from asyncrl.reasons import GroupReason

Reward = float | list[float] | None


@dataclass(frozen=True)
class AgentEnded:
    """What an agent returned: its reward, a reward per call, or None (the task scores)."""

    reward: Reward


class AgentFailure(Exception):
    """An episode's agent that failed; `reason` is a `GroupReason` `agent_*` member."""

    def __init__(self, reason: GroupReason, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


def reward_of(value: object) -> Reward:
    """`value` if it is a reward the agent may return, else `agent_error`."""

    def number(x: object) -> bool:
        return isinstance(x, numbers.Real) and not isinstance(x, bool) and math.isfinite(x)

    if value is None or number(value):
        return None if value is None else float(value)  # type: ignore[arg-type]
    if isinstance(value, list | tuple) and value and all(number(x) for x in value):
        return [float(x) for x in value]
    raise AgentFailure(
        GroupReason.AGENT_ERROR,
        f"returned {value!r:.200}: expected a finite number, a list of them or None",
    )
