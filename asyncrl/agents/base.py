"""The agent seam: what runs one episode's agent against its gateway session.

It only declares: `Agent` and the failure type. The members beside it are `python.py` (your
function, in the worker), `command.py` (any executable, a process group per episode),
`remote.py` (either of them on `asyncrl agent-server` runners) and `verifiers.py` (a
verifiers environment's episodes, in a runner of the verifiers venv); the task builder
(`asyncrl.tasks.build.build_agent`) picks one by the config's `type`, and one episode function
drives any of them (`asyncrl.agents.episode`).
"""

from __future__ import annotations

from typing import Any, Protocol

from asyncrl.episodes.base import EpisodeFailed
from asyncrl.reasons import GroupReason


class Agent(Protocol):
    """Runs an agent once per episode. Its calls reach the episode's gateway session through
    `base_url` and `api_key` (OpenAI's credentials), never through this interface: the agent
    need not know that it is trained."""

    async def run(self, item: dict[str, Any], base_url: str, api_key: str) -> Any:
        """What the agent returned (or printed) for `item` (`id`, `prompt`, `answer`): a
        reward, one per call, or None. What it raises fails the episode's group (an
        `AgentFailure` with its reason, anything else `agent_error`). Cancelled when the
        episode is given up, it ends what it started (a command's process group)."""
        ...

    def shutdown(self) -> None:
        """The worker stops: release what every episode shared (threads, a runner process)."""
        ...


class AgentFailure(EpisodeFailed):
    """An episode's agent that failed; `reason` is a `GroupReason` `agent_*` member."""

    def __init__(self, reason: GroupReason, detail: str) -> None:
        super().__init__(reason, detail)
