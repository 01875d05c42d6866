"""An agent episode, top to bottom: open a gateway session → run the agent → serve each of its
calls within the episode's budget → its samples, one per transcript segment.

The agent (`asyncrl.agents.base.Agent`: any member) runs as a task of the episode on the
environments' event loop, with the session's credentials. Each chat call arrives on a gateway
HTTP thread, is planned by the session's transcript and handed to the episode (`post`, the one
thread crossing), which bounds it — the run's sampling, the episode's `max_calls` and
`max_tokens`, the context — and awaits it as a turn like any episode's, batched with every
other ready turn into one engine call. The generation goes back to the HTTP thread, which cuts
it at stop strings, records it in the transcript and replies. When the agent returns, its
session ends (later calls: 410) and each transcript segment becomes a sample; however the
episode ends, its session ends with it and the agent's task is cancelled (a command agent's
process group killed).

Samples and the wire: an agent renders its own prompt (system turn, tools, its history), so
the episodes of one group need not share the item's prompt. Each sample's response is its
segment's whole prompt, loss-masked, then its tokens; the group's `prompt_ids` are the longest
run of masked tokens every sample begins with (the chat template's head and whatever the
agents rendered alike), cut from each response. The trainer conditions on prompt + response
as always, so nothing on the wire or in the trainer changed.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import numpy as np

from asyncrl.agents.base import Agent, AgentFailure
from asyncrl.episodes.base import EpisodeFailed, Turns
from asyncrl.gateway.sessions import Reward, parse_reward
from asyncrl.protocol import Sample
from asyncrl.reasons import GroupReason

if TYPE_CHECKING:
    from asyncrl.agents.config import AgentLimits
    from asyncrl.engines.config import SamplingParams
    from asyncrl.gateway.server import Gateway
    from asyncrl.gateway.sessions import PendingCall, Session
    from asyncrl.gateway.transcript import Segment
    from asyncrl.items import PromptItem


@dataclass(frozen=True)
class AgentEpisodes:
    """The episodes of one agent over one gateway (`task.agent`; a verifiers environment)."""

    agent: Agent
    limits: AgentLimits
    gateway: Gateway
    on_session: Callable[[], None] | None = None

    def episode(
        self, turns: Turns, item: PromptItem, episode_id: str
    ) -> Coroutine[Any, Any, list[Sample]]:
        return self._run(turns, item)

    async def _run(self, turns: Turns, item: PromptItem) -> list[Sample]:
        calls: asyncio.Queue[PendingCall] = asyncio.Queue()
        loop = asyncio.get_running_loop()

        def post(call: PendingCall) -> None:  # on the call's HTTP thread
            loop.call_soon_threadsafe(calls.put_nowait, call)

        session = self.gateway.open(post)
        if self.on_session is not None:
            self.on_session()
        run = asyncio.ensure_future(self._reward(item, session))
        run.add_done_callback(_retrieved)
        why = "its episode ended"
        try:
            budget = _Budget(self.limits, turns)
            while (call := await _next_call(calls, run)) is not None:
                gen = await turns.generate(call.prompt_ids, budget.params(call))
                budget.spent(len(gen.token_ids))
                call.resolve(gen)
            reward = run.result()  # the agent's failure, if it failed
            segments = session.transcript.samples()
            if not segments:
                raise AgentFailure(GroupReason.AGENT_NO_CALLS, "the agent returned without a call")
            if reward is None:  # nothing returned or posted: the task scores its last answer
                reward = await turns.score(session.last_content)
            return episode_samples(segments, segment_rewards(segments, reward))
        except EpisodeFailed as exc:
            why = f"its group failed ({exc.reason})"
            raise
        except asyncio.CancelledError as exc:  # its group failed, or the worker stops
            why = str(exc) or "the rollout worker is stopping"
            raise
        finally:
            run.cancel()
            self.gateway.sessions.close(session, why)

    async def _reward(self, item: PromptItem, session: Session) -> Reward:
        """The agent's run: its reward (returned, else posted), or `AgentFailure`."""
        given = {"id": item.prompt_id, "prompt": item.prompt, "answer": item.answer}
        base_url = self.gateway.base_url(session)
        value = await bounded(self.agent.run(given, base_url, session.token), self.limits.timeout_s)
        return session.posted if value is None else reward_of(value)

    def group(self, item: PromptItem, samples: list[Sample]) -> tuple[PromptItem, list[Sample]]:
        try:
            return shared_prompt(item, samples)
        except ValueError as exc:
            raise EpisodeFailed(GroupReason.AGENT_ERROR, str(exc)) from None

    def close(self) -> None:
        self.gateway.close()
        self.agent.shutdown()


@dataclass
class _Budget:
    """What the episode's calls may still spend."""

    limits: AgentLimits
    turns: Turns
    calls: int = 0
    generated: int = 0

    def params(self, call: PendingCall) -> SamplingParams:
        """The sampling of `call`: bounded by the run's, the episode's budget and the context;
        `AgentFailure` for a call past them."""
        limits, sampling, max_context = self.limits, self.turns.sampling, self.turns.max_context
        room = min(call.max_new_tokens, sampling.max_new_tokens)
        if limits.max_tokens is not None:
            room = min(room, limits.max_tokens - self.generated)
        if self.calls >= limits.max_calls:
            over = f"call {self.calls + 1} past max_calls {limits.max_calls}"
            raise AgentFailure(GroupReason.AGENT_OVER_BUDGET, over)
        if room < 1:
            over = f"{self.generated} tokens generated: none left of max_tokens {limits.max_tokens}"
            raise AgentFailure(GroupReason.AGENT_OVER_BUDGET, over)
        if max_context is not None:
            room = min(room, max_context - len(call.prompt_ids))
            if room < 1:
                raise AgentFailure(
                    GroupReason.AGENT_CONTEXT_TOO_LONG,
                    f"a prompt of {len(call.prompt_ids)} tokens leaves no room within the "
                    f"{max_context} positions",
                )
        return sampling.model_copy(update={"max_new_tokens": room})

    def spent(self, tokens: int) -> None:
        self.calls += 1
        self.generated += tokens


async def _next_call(
    calls: asyncio.Queue[PendingCall], run: asyncio.Future[Any]
) -> PendingCall | None:
    """The agent's next call; None once its run has ended."""
    if not calls.empty():
        return calls.get_nowait()
    if run.done():
        return None
    call = asyncio.ensure_future(calls.get())
    try:
        await asyncio.wait((call, run), return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not call.done():
            call.cancel()
    return call.result() if call.done() and not call.cancelled() else None


def _retrieved(run: asyncio.Future[Any]) -> None:
    """Marks a run's failure seen: an episode that ended first (its budget) never reads it."""
    if not run.cancelled():
        run.exception()


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


def reward_of(value: object) -> Reward:
    """`value` if it is a reward the agent may return, else `agent_error`."""
    try:
        return parse_reward(value)
    except ValueError as exc:
        raise AgentFailure(GroupReason.AGENT_ERROR, str(exc)) from None


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
