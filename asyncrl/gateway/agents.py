"""Agents as a task (`task.agent`): the user's function run once per episode against its own
gateway session, and what its episode becomes: a sample per transcript segment.

A `python` agent runs on the rollout worker's environment event loop (`asyncrl.rollout.env_loop`):
an `async def` as a task there, a plain function on a thread of its own, each under the
episode's `timeout_s`. Whatever it raises, a BaseException included, fails only its group
(`agent_error`); past its time, `agent_timeout` (a thread cannot be stopped: its session is
ended, so its next call fails at once). A `command` agent is a process group per episode
(`asyncrl.gateway.command`), killed when its episode ends or its group fails. A `remote` agent
is either of them on an agent runner (`asyncrl.gateway.runner`), one request per episode
(`asyncrl.gateway.remote`). A verifiers environment (`task.type: verifiers`) is its own agent:
its episodes run in the worker's verifiers runner (`asyncrl.gateway.verifiers`).

Samples and the wire: an agent renders its own prompt (system turn, tools, its history), so
the episodes of one group need not share the item's prompt. Each sample's response is its
segment's whole prompt, loss-masked, then its tokens; the group's `prompt_ids` are the longest
run of masked tokens every sample begins with (the chat template's head and whatever the
agents rendered alike), cut from each response. The trainer conditions on prompt + response
as always, so nothing on the wire or in the trainer changed.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from functools import partial
from typing import TYPE_CHECKING, Any

import numpy as np

from asyncrl.environments.base import contained
from asyncrl.gateway.command import kill_group, run_command
from asyncrl.gateway.outcome import AgentEnded, AgentFailure, reward_of
from asyncrl.items import PromptItem
from asyncrl.plugins import load_object
from asyncrl.protocol import Sample
from asyncrl.reasons import GroupReason

if TYPE_CHECKING:
    from asyncrl.gateway.config import AgentConfig, CommandAgentConfig, PythonAgentConfig
    from asyncrl.gateway.remote import RemoteAgent
    from asyncrl.gateway.server import Gateway
    from asyncrl.gateway.sessions import PendingCall, Session
    from asyncrl.gateway.transcript import Segment
    from asyncrl.gateway.verifiers import VerifiersAgent
    from asyncrl.tasks.config import VerifiersTaskConfig

_THREADS = 256
"""Sync agents running at once in a worker (a thread each, for their whole episode)."""


class LocalAgent:
    """A `python` or `command` agent's episodes where they run: the rollout worker, or an
    agent runner (`asyncrl agent-server`)."""

    def __init__(self, cfg: PythonAgentConfig | CommandAgentConfig) -> None:
        self.cfg = cfg
        self._fn = None if cfg.type == "command" else load_object(cfg.path, cfg.python_path)
        self._threads: ThreadPoolExecutor | None = None

    async def run(
        self,
        given: dict[str, Any],
        base_url: str,
        api_key: str,
        started: Callable[[int], None] = lambda pid: None,
    ) -> Any:
        """What the agent returned (or printed) for `given`; what it raised passes."""
        cfg = self.cfg
        if cfg.type == "command":
            return await run_command(cfg, given, base_url, api_key, started)
        assert self._fn is not None
        call = partial(self._fn, given, base_url=base_url, api_key=api_key, **cfg.kwargs)
        return await contained(self._call(call))

    async def _call(self, call: Callable[[], Any]) -> Any:
        if inspect.iscoroutinefunction(self._fn):
            return await call()
        if self._threads is None:
            self._threads = ThreadPoolExecutor(_THREADS, thread_name_prefix="agent")
        value = await asyncio.get_running_loop().run_in_executor(self._threads, call)
        return await value if inspect.isawaitable(value) else value

    def shutdown(self) -> None:
        if self._threads is not None:
            self._threads.shutdown(wait=False, cancel_futures=True)


async def bounded(run: Awaitable[Any], timeout_s: float) -> Any:
    """`run`'s value within `timeout_s`; what it raised as `AgentFailure` (one passes as is)."""
    try:
        async with asyncio.timeout(timeout_s) as deadline:
            return await run
    except TimeoutError:
        if deadline.expired():
            raise AgentFailure(
                GroupReason.AGENT_TIMEOUT, f"still running after {timeout_s}s"
            ) from None
        raise AgentFailure(GroupReason.AGENT_ERROR, "TimeoutError raised by the agent") from None
    except AgentFailure:
        raise
    except Exception as exc:  # Escaped too: a BaseException of the agent's own
        raise AgentFailure(GroupReason.AGENT_ERROR, f"{type(exc).__name__}: {exc}") from exc


class Agents:
    """The agent of `task.agent` over one worker's gateway: sessions, runs, samples."""

    def __init__(
        self,
        cfg: AgentConfig | VerifiersTaskConfig,
        gateway: Gateway,
        on_session: Callable[[], None] | None = None,
    ) -> None:
        self.cfg = cfg
        self.gateway = gateway
        self._on_session = on_session
        self._agent: LocalAgent | RemoteAgent | VerifiersAgent
        if cfg.type == "remote":
            from asyncrl.gateway.remote import RemoteAgent

            self._agent = RemoteAgent(cfg)
        elif cfg.type == "verifiers":
            from asyncrl.gateway.verifiers import VerifiersAgent

            self._agent = VerifiersAgent(cfg)
        else:
            self._agent = LocalAgent(cfg)
        self._groups: dict[str, int] = {}
        """Each live command agent's process group, by its session's key."""

    @property
    def max_calls(self) -> int:
        return self.cfg.max_calls

    @property
    def max_tokens(self) -> int | None:
        return self.cfg.max_tokens

    def open(self, post: Callable[[PendingCall], None]) -> Session:
        if self._on_session is not None:
            self._on_session()
        return self.gateway.open(post)

    def close(self, session: Session, why: str) -> None:
        self.gateway.sessions.close(session, why)
        pid = self._groups.pop(session.token, None)
        if pid is not None:
            kill_group(pid)

    async def run(self, item: PromptItem, session: Session) -> AgentEnded:
        """The agent's episode on the running loop: its reward, or `AgentFailure`."""
        given = {"id": item.prompt_id, "prompt": item.prompt, "answer": item.answer}
        base_url = self.gateway.base_url(session)
        started = partial(self._started, session)
        try:
            value = await bounded(
                self._agent.run(given, base_url, session.token, started), self.cfg.timeout_s
            )
        finally:
            self._groups.pop(session.token, None)
        if value is None and session.posted is not None:
            return session.posted
        return AgentEnded(reward_of(value))

    def _started(self, session: Session, pid: int) -> None:
        """A command agent's process group is up; one whose session already ended goes now."""
        self._groups[session.token] = pid
        if session.ended is not None:
            kill_group(pid)

    def shutdown(self) -> None:
        self.gateway.close()
        self._agent.shutdown()


def episode_samples(segments: list[Segment], rewards: list[float]) -> list[Sample]:
    """A sample per segment (`rewards[i]` for segment i), its whole prompt opening the response
    loss-masked (`Segment.rebase`); `shared_prompt` cuts what the group's samples share."""
    samples = []
    for seg, reward in zip(segments, rewards, strict=True):
        whole = seg.rebase(0)
        samples.append(
            Sample(
                response_ids=whole.ids,
                logprobs=whole.logprobs,
                versions=whole.versions,
                reward=float(reward),
                finish="stop" if seg.finish == "stop" else "length",
                meta={"calls": seg.calls},
                loss_mask=whole.loss_mask,
            )
        )
    return samples


def segment_rewards(segments: list[Segment], reward: float | list[float]) -> list[float]:
    """Each segment's reward: the episode's, or of per-call rewards the one of the segment's
    last call (`agent_error` unless there is one per call)."""
    if not isinstance(reward, list):
        return [reward] * len(segments)
    calls = sum(seg.calls for seg in segments)
    if len(reward) != calls:
        raise AgentFailure(
            GroupReason.AGENT_ERROR, f"returned {len(reward)} rewards for {calls} calls"
        )
    ends = np.cumsum([seg.calls for seg in segments]) - 1
    return [reward[int(i)] for i in ends]


def shared_prompt(item: PromptItem, samples: list[Sample]) -> tuple[PromptItem, list[Sample]]:
    """The group's prompt: the longest masked run every sample's response begins with, cut
    from each (see the module docstring); ValueError when they share no first token."""
    heads = []
    for s in samples:
        assert s.loss_mask is not None
        trained = np.flatnonzero(s.loss_mask)
        heads.append(s.response_ids[: trained[0] if len(trained) else len(s.response_ids) - 1])
    k = min(len(h) for h in heads)
    for h in heads[1:]:
        differ = np.flatnonzero(h[:k] != heads[0][:k])
        k = int(differ[0]) if len(differ) else k
    if k == 0:
        raise ValueError("the episodes' prompts share no first token")
    cut = [
        replace(
            s,
            response_ids=s.response_ids[k:],
            logprobs=s.logprobs[k:],
            versions=s.versions[k:],
            loss_mask=None if s.loss_mask is None else s.loss_mask[k:],
        )
        for s in samples
    ]
    return replace(item, prompt_ids=heads[0][:k].tolist()), cut
