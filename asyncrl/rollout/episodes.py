"""Episodes in flight: many multi-turn episodes at once, so that waiting on environments does not
idle the engine.

An episode is in one of three places: ready for a generation turn, inside its environment (a
task on the scheduler's event loop thread, `asyncrl.rollout.env_loop`, possibly awaiting a
tool), or ended. Each `advance` takes back the environment steps that returned, then runs one
`engine.generate` over every ready episode, so the engine always batches whatever is ready
while the rest wait. A group (the n episodes of one prompt) is handed back as soon as its last
episode ends. A plain `Task` gives one-turn episodes scored inline, with no event loop
involved: the single-turn path is one generate and one score.

The response of a multi-turn sample holds every turn in order. Generated tokens keep the
behaviour log-prob and policy version the engine recorded, so a weight swap between turns shows
as a version step; observation tokens get loss mask 0, log-prob 0 and the version of the token
before them, so versions stay non-decreasing and the trainer does not learn to predict them.

Worked example (a 2-turn episode, weights v3 → v4 swapped while the tool ran):

    tokens    4  6  <eos> | <bos> 5  6  +  7  8  = | 1  3  4  <eos>
    versions  3  3  3     | 3     3  3  3  3  3  3 | 4  4  4  4
    loss_mask 1  1  1     | 0     0  0  0  0  0  0 | 1  1  1  1
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import numpy as np

from asyncrl.engines.base import EngineError, Generation, RolloutEngine
from asyncrl.engines.config import SamplingParams
from asyncrl.environments.base import (
    Environment,
    EnvironmentFailure,
    StepResult,
    render_observation,
)
from asyncrl.environments.tools import tool_call_counts
from asyncrl.gateway.agents import episode_samples, segment_rewards, shared_prompt
from asyncrl.gateway.outcome import AgentEnded, AgentFailure
from asyncrl.items import PromptItem
from asyncrl.metrics.breakdown import phase
from asyncrl.protocol import Sample
from asyncrl.reasons import GroupReason
from asyncrl.rollout.env_loop import Call, EnvironmentLoop, Posted, describe
from asyncrl.tasks.base import EpisodicTask, Task
from asyncrl.tasks.isolated import RewardFailure

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from asyncrl.gateway.agents import Agents
    from asyncrl.gateway.sessions import PendingCall, Session

T = TypeVar("T")
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GenerateCall:
    """What one engine call did, for metrics."""

    seconds: float
    response_tokens: int
    prompt_tokens: int
    cached_tokens: int
    """Of `prompt_tokens`, those served from the engine's prefix cache."""


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
    """One per episode, in episode order."""
    created_at: float
    """Unix seconds when the group's episodes started."""


@dataclass
class FailedGroup(Generic[T]):
    """A group given up because a generation or an environment step failed."""

    tag: T
    reason: str
    """Short stable code, an `asyncrl.reasons.GroupReason` (`engine_{reason}` of an
    EngineError, `env_{reason}` of an EnvironmentFailure, `reward_*` of a RewardFailure,
    wherever it was raised); `stale` for a group `EpisodeScheduler.drop_older_than` gave up
    (the trainer would drop it)."""
    detail: str


@dataclass
class _Group(Generic[T]):
    tag: T
    item: PromptItem
    samples: list[list[Sample] | None]
    """Each episode's samples once it ended: one, or an agent's one per transcript segment."""
    created_at: float
    failed: bool = False
    oldest: int | None = None
    """The version of its oldest generated token (None before the first)."""
    sessions: list[Session] = field(default_factory=list)
    """Its agents' gateway sessions (`task.agent`), ended with the group."""

    def saw(self, versions: np.ndarray) -> None:
        if len(versions):
            first = int(versions[0])
            self.oldest = first if self.oldest is None else min(self.oldest, first)

    @property
    def done(self) -> bool:
        return all(s is not None for s in self.samples)


@dataclass
class _Episode:
    group: _Group[Any]
    index: int
    env: Environment | None
    context: list[int]
    ids: list[np.ndarray] = field(default_factory=list)
    logprobs: list[np.ndarray] = field(default_factory=list)
    versions: list[np.ndarray] = field(default_factory=list)
    mask: list[np.ndarray] = field(default_factory=list)
    turns: int = 0
    finish: str = "length"
    text: str = ""
    """The last turn's decoded response, scored by the task when the environment gives no
    reward."""
    ended_by: int | None = None
    """The token that ended the last turn (an end of turn), None when the token limit cut it:
    what a chat observation's rendering goes on from."""
    first_observation: list[int] = field(default_factory=list)
    """What `reset` returned, rendered: joins the response before the first turn, with that
    turn's version (none is known before it)."""
    episodic: bool = False
    routed: np.ndarray | None = None
    """The last turn's routed experts: its prompt is the whole context, so they cover every
    token of the sample (earlier turns' tokens as that turn's prefill routed them)."""
    session: Session | None = None
    """An agent episode's gateway session; its calls are its turns."""
    call: PendingCall | None = None
    """The agent's call this turn answers (`context` is its prompt)."""
    params: SamplingParams | None = None
    """This turn's sampling when not the run's (an agent's call: its token bound)."""
    calls: int = 0
    generated: int = 0

    def __post_init__(self) -> None:
        self.episodic = self.env is not None

    def add_turn(self, gen: Generation) -> None:
        if not self.turns:  # versions only grow along an episode
            self.group.saw(gen.versions)
        if self.first_observation and not self.turns:
            self._masked(self.first_observation, int(gen.versions[0]) if len(gen.versions) else 0)
        self.ids.append(gen.token_ids)
        self.logprobs.append(gen.logprobs)
        self.versions.append(gen.versions)
        self.mask.append(np.ones(len(gen.token_ids), np.uint8))
        self.context.extend(gen.token_ids.tolist())
        self.turns += 1
        self.finish = gen.finish
        self.routed = gen.routed_experts
        stopped = gen.finish == "stop" and len(gen.token_ids)
        self.ended_by = int(gen.token_ids[-1]) if stopped else None

    def answer(self, gen: Generation) -> None:
        """Hand `gen` to the agent's call waiting on it (task.agent)."""
        call, self.call = self.call, None
        assert call is not None
        self.calls += 1
        self.generated += len(gen.token_ids)
        self.group.saw(gen.versions)
        call.resolve(gen)

    def observe(self, ids: list[int]) -> None:
        self.context.extend(ids)
        if not self.turns:
            self.first_observation = ids
        elif ids:
            self._masked(ids, int(self.versions[-1][-1]))

    def _masked(self, ids: list[int], version: int) -> None:
        n = len(ids)
        self.ids.append(np.asarray(ids, np.int32))
        self.logprobs.append(np.zeros(n, np.float32))
        self.versions.append(np.full(n, version, np.int32))
        self.mask.append(np.zeros(n, np.uint8))

    def sample(self, reward: float) -> Sample:
        mask = np.concatenate(self.mask)
        ids = np.concatenate(self.ids).astype(np.int32)
        routed = self.routed
        if routed is not None and len(routed) != len(self.group.item.prompt_ids) + len(ids) - 1:
            routed = None  # tokens joined after the last turn (a final observation): not routed
        return Sample(
            response_ids=ids,
            logprobs=np.concatenate(self.logprobs).astype(np.float32),
            versions=np.concatenate(self.versions).astype(np.int32),
            reward=float(reward),
            finish="stop" if self.finish == "stop" else "length",
            meta={"turns": self.turns} if self.episodic else {},
            # One-turn samples keep the wire as it was: no mask means every token is trained on.
            loss_mask=None if mask.all() else mask,
            routed_experts=routed,
        )


class EpisodeScheduler(Generic[T]):
    """Runs the episodes of started groups; one thread (the caller's) drives generation.

    `start` begins a group's n episodes, `advance` moves every episode on by at most one step and
    returns the groups that ended. `inflight` counts the episodes of groups not yet returned.

    `max_context` bounds the positions of every turn: context plus `max_new_tokens`. An episode
    whose next turn would pass it ends before that turn, its observation never prefilled: as
    truncated (finish "length", scored by the task on its last turn, like an environment that
    ends without a reward) after a turn, or its group failed (`context_too_long`) before the
    first, since no sample is left to keep. The model is never run, nor a sample trained, at
    positions it does not have.
    """

    def __init__(
        self,
        engine: RolloutEngine,
        task: Task,
        tokenizer: PreTrainedTokenizerBase,
        sampling: SamplingParams,
        *,
        batch_wait_s: float = 0.0,
        max_context: int | None = None,
        on_generate: Callable[[GenerateCall], None] | None = None,
        on_env_error: Callable[[str], None] | None = None,
        on_tool_calls: Callable[[str, int], None] | None = None,
        agents: Agents | None = None,
    ) -> None:
        self._engine = engine
        self._task = task
        self._episodic = task if isinstance(task, EpisodicTask) else None
        self._tokenizer = tokenizer
        self._sampling = sampling
        self._on_generate = on_generate
        self._on_env_error = on_env_error
        self._on_tool_calls = on_tool_calls
        self._batch_wait_s = batch_wait_s
        self._max_context = max_context
        self._agents = agents
        self._envs: EnvironmentLoop[_Episode] = EnvironmentLoop()
        self._ready: list[_Episode] = []
        self._ready_since = 0.0  # when the oldest ready episode became ready (monotonic)
        self._groups: list[_Group[T]] = []
        self._failed: list[FailedGroup[T]] = []
        self.inflight = 0
        self.tokens = 0
        """Tokens generated so far (observations not counted)."""

    def start(self, tag: T, item: PromptItem, n: int, episode_prefix: str) -> None:
        """Begin the n episodes of `item`; episode i's environment gets the id
        `{episode_prefix}/{i}`."""
        group: _Group[T] = _Group(tag, item, [None] * n, time.time())
        self._groups.append(group)
        self.inflight += n
        for i in range(n):
            if self._agents is not None:
                self._start_agent(_Episode(group, i, None, []), self._agents)
                continue
            if self._episodic is None:
                ep = _Episode(group, i, None, list(item.prompt_ids))
                if not self._turn_fits(ep, 0):
                    self._end_full(ep, 0)
                    return
                self._make_ready(ep)
                continue
            try:
                env = self._episodic.environment(item, f"{episode_prefix}/{i}")
            except KeyboardInterrupt:  # Ctrl-C arrives so on this thread: not the task's
                raise
            except BaseException as exc:  # e.g. an answer the task cannot parse, a sys.exit()
                self._fail(group, GroupReason.TASK_ERROR, describe(exc))
                return
            self._envs.opened(env)
            self._to_env([(_Episode(group, i, env, list(item.prompt_ids)), None)])

    def advance(self, wait_s: float) -> tuple[list[FinishedGroup[T]], list[FailedGroup[T]]]:
        """Take back returned environment steps (waiting up to `wait_s` for one when no episode
        is ready for a turn), generate one turn for every ready episode, and return the groups
        that ended or failed since the last call."""
        with phase("env"):
            self._take_back(wait_s if not self._ready else 0.0)
            # Every generate call pays its decode steps' fixed overhead once, so ready episodes
            # wait a little for others coming back from their environments to share one.
            deadline = self._ready_since + self._batch_wait_s
            while self._ready and self._others() and (left := deadline - time.monotonic()) > 0:
                self._take_back(left)
        if self._ready:
            self._generate()
        finished: list[FinishedGroup[T]] = []
        for g in self._groups:
            # A failed group counts in flight until it is handed back, so that the caller, which
            # advances only while episodes are in flight, gets it.
            if g.failed:
                self.inflight -= len(g.samples)
            elif g.done:
                samples = [s for ep in g.samples if ep is not None for s in ep]
                item = g.item
                if g.sessions:
                    try:
                        item, samples = shared_prompt(item, samples)
                    except ValueError as exc:
                        self._fail(g, GroupReason.AGENT_ERROR, str(exc))
                        self.inflight -= len(g.samples)
                        continue
                finished.append(FinishedGroup(g.tag, item, samples, g.created_at))
                self.inflight -= len(g.samples)
        self._groups = [g for g in self._groups if not g.done and not g.failed]
        failed, self._failed = self._failed, []
        return finished, failed

    def _others(self) -> int:
        """Episodes away whose turn may come back soon: those inside an environment, and
        agents not blocked on a call of theirs that is ready."""
        return self._envs.pending - sum(ep.call is not None for ep in self._ready)

    def drop_older_than(self, version: int) -> None:
        """Give up every group holding a token generated before `version`, handed back by the
        next `advance` as failed with reason `STALE`: trained at the engine's version or later,
        with `version` = that version − η, each would be dropped stale, so its episodes stop
        costing generation and environment time (a long multi-turn tail's most of all)."""
        for g in self._groups:
            if not g.failed and not g.done and g.oldest is not None and g.oldest < version:
                self._fail(g, STALE, f"oldest token of version {g.oldest}, bound {version}")

    def close(self) -> None:
        """Cancel the environment steps still awaiting their tools, close every environment
        still open (episodes cut short: a session on an env-server is deleted), best effort
        within a few seconds, and end the loop thread. Agents' sessions end first, so that no
        call of theirs waits on a scheduler that is gone."""
        if self._agents is not None:
            self._agents.shutdown()
        self._envs.close()

    def _fail(self, group: _Group[T], reason: str, detail: str) -> None:
        if group.failed:
            return
        group.failed = True
        self._failed.append(FailedGroup(group.tag, reason, detail))
        if self._agents is not None:
            for session in group.sessions:
                self._agents.close(session, f"its group failed ({reason})")
        # Its other episodes are dropped now; those inside an environment are closed on return.
        for ep in self._ready:
            if ep.group is group:
                self._close_env(ep)
        self._ready = [ep for ep in self._ready if ep.group is not group]

    def _take_back(self, wait_s: float) -> None:
        for ep, result in self._envs.take_back(wait_s):
            if ep.session is not None:
                self._agent_returned(ep, result)
                continue
            if isinstance(result, StepResult) and self._on_tool_calls is not None:
                for outcome, n in tool_call_counts(result.info):
                    self._on_tool_calls(outcome, n)
            done = isinstance(result, StepResult) and result.done
            if ep.group.failed or done or isinstance(result, Exception):
                self._close_env(ep)  # the episode is over: its session goes now
            if ep.group.failed:
                continue
            if isinstance(result, RewardFailure):
                self._fail(ep.group, result.reason, result.detail)
            elif isinstance(result, Exception):
                failure = (
                    result
                    if isinstance(result, EnvironmentFailure)
                    else EnvironmentFailure("error", describe(result))
                )
                if self._on_env_error is not None:
                    self._on_env_error(failure.reason)
                self._fail(ep.group, f"env_{failure.reason}", failure.detail)
            elif isinstance(result, StepResult) and result.done:
                if result.reward is None:
                    self._score(ep, partial(self._task.score, ep.group.item, ep.text))
                else:
                    self._score(ep, partial(float, result.reward))
            else:
                obs = result.observation if isinstance(result, StepResult) else result.first
                try:
                    ids = render_observation(self._tokenizer, obs, ep.ended_by)
                except Exception as exc:  # chat messages for a tokenizer without a template
                    self._close_env(ep)
                    self._fail(ep.group, "env_malformed", f"rendering {obs!r:.200}: {exc}")
                    continue
                if not self._turn_fits(ep, len(ids)):
                    self._end_full(ep, len(ids))
                    continue
                ep.observe(ids)
                self._make_ready(ep)

    def _generate(self) -> None:
        batch, self._ready = self._ready, []
        # Turns of one sampling share a generate call (agents' calls may bound their tokens).
        parts: dict[tuple[int, tuple[int, ...] | None], list[_Episode]] = {}
        for ep in batch:
            params = ep.params or self._sampling
            parts.setdefault((params.max_new_tokens, params.stop_token_ids), []).append(ep)
        try:
            for part in parts.values():
                self._generate_turn(part, part[0].params or self._sampling)
        finally:
            # `_fail` closes the environments of ready episodes; these were taken out of that list.
            for ep in batch:
                if ep.group.failed:
                    self._close_env(ep)

    def _generate_turn(self, batch: list[_Episode], params: SamplingParams) -> None:
        t0 = time.monotonic()
        try:
            with phase("generate"):
                gens: list[Generation | None] = list(
                    self._engine.generate([ep.context for ep in batch], params)
                )
            if len(gens) != len(batch):
                raise RuntimeError(f"{len(gens)} generations for {len(batch)} prompts")
        except EngineError as exc:
            gens = exc.generations or [None] * len(batch)
            for ep, gen in zip(batch, gens, strict=True):
                if gen is None:
                    self._fail(ep.group, f"engine_{exc.reason}", exc.detail)
        except Exception as exc:
            # Not one of the engine's own failures: a bug, or input it chokes on. Which prompt
            # caused it is unknown, so the whole call's groups fail (dead-lettered, counted);
            # the worker goes on with the rest.
            log.exception("generate failed for %d episode(s)", len(batch))
            gens = [None] * len(batch)
            for ep in batch:
                self._fail(ep.group, GroupReason.ENGINE_ERROR, describe(exc))
        done = [(ep, g) for ep, g in zip(batch, gens, strict=True) if g is not None]
        n_tokens = sum(len(g.token_ids) for _, g in done)
        self.tokens += n_tokens
        if self._on_generate is not None:
            self._on_generate(
                GenerateCall(
                    seconds=time.monotonic() - t0,
                    response_tokens=n_tokens,
                    prompt_tokens=sum(len(ep.context) for ep, _ in done),
                    cached_tokens=sum(g.cached_tokens for _, g in done),
                )
            )
        for ep, gen in done:
            if ep.call is not None and not ep.group.failed:
                ep.answer(gen)
        done = [(ep, g) for ep, g in done if not ep.group.failed and ep.session is None]
        try:
            texts = self._tokenizer.batch_decode(
                [g.token_ids.tolist() for _, g in done], skip_special_tokens=True
            )
        except Exception as exc:  # tokens the tokenizer does not know came out of the engine
            log.exception("decoding %d response(s) failed", len(done))
            for ep, _ in done:
                self._fail(ep.group, GroupReason.ENGINE_ERROR, describe(exc))
            return
        to_env = []
        for (ep, gen), text in zip(done, texts, strict=True):
            if ep.group.failed:  # a sibling's score failed just now
                continue
            ep.add_turn(gen)
            ep.text = text
            if ep.env is None:
                self._score(ep, partial(self._task.score, ep.group.item, text))
            else:
                to_env.append((ep, text))
        if to_env:
            self._to_env(to_env)

    def _score(self, ep: _Episode, reward: Callable[[], float]) -> None:
        """End `ep` with the reward the task's code computes; its group fails if that raises."""
        value = self._reward(ep, reward)
        if value is not None:
            ep.group.samples[ep.index] = [ep.sample(value)]

    def _reward(self, ep: _Episode, reward: Callable[[], float]) -> float | None:
        """What the task's code computes; None when it raised (its group failed)."""
        try:
            with phase("env"):
                return reward()
        except RewardFailure as exc:  # the user's reward, isolated: its own reason, no trace here
            log.warning("reward failed: %s", exc)
            self._fail(ep.group, exc.reason, exc.detail)
        except KeyboardInterrupt:  # Ctrl-C arrives so on this thread: not the task's
            raise
        except BaseException as exc:  # a user task's score may sys.exit(): its group fails
            log.exception("scoring an episode failed")
            self._fail(ep.group, GroupReason.TASK_ERROR, describe(exc))
        return None

    # -- agents (task.agent): an episode is its agent's run; each of its calls is a turn ------

    def _start_agent(self, ep: _Episode, agents: Agents) -> None:
        ep.session = agents.open(partial(self._envs.post, ep))
        ep.group.sessions.append(ep.session)
        self._envs.spawn(ep, partial(agents.run, ep.group.item, ep.session))

    def _agent_returned(self, ep: _Episode, result: object) -> None:
        """A call of `ep`'s agent (made ready for a turn), or its end (samples, or failure)."""
        agents, session = self._agents, ep.session
        assert agents is not None and session is not None
        if isinstance(result, Posted):
            call: PendingCall = result.value
            if ep.group.failed:
                call.refuse("its group failed")
            else:
                self._agent_call(ep, call, agents)
            return
        agents.close(session, "its episode ended")
        if ep.group.failed:
            return
        if isinstance(result, AgentFailure):
            self._fail(ep.group, result.reason, result.detail)
            return
        assert isinstance(result, AgentEnded)  # `Agents.run` turns any failure into one
        segments = session.transcript.samples()
        if not segments:
            self._fail(ep.group, GroupReason.AGENT_NO_CALLS, "the agent returned without a call")
            return
        reward = result.reward
        if reward is None:
            text = session.last_content
            reward = self._reward(ep, partial(self._task.score, ep.group.item, text))
            if reward is None:
                return
        try:
            ep.group.samples[ep.index] = episode_samples(
                segments, segment_rewards(segments, reward)
            )
        except AgentFailure as exc:
            self._fail(ep.group, exc.reason, exc.detail)

    def _agent_call(self, ep: _Episode, call: PendingCall, agents: Agents) -> None:
        """Make `call` `ep`'s next turn, bounded by the run's sampling, the episode's budget
        and the context; a call past them fails the group."""
        room = min(call.max_new_tokens, self._sampling.max_new_tokens)
        if agents.max_tokens is not None:
            room = min(room, agents.max_tokens - ep.generated)
        over = (
            f"call {ep.calls + 1} past max_calls {agents.max_calls}"
            if ep.calls >= agents.max_calls
            else f"{ep.generated} tokens generated: none left of max_tokens {agents.max_tokens}"
            if room < 1
            else None
        )
        if over is not None:
            self._fail(ep.group, GroupReason.AGENT_OVER_BUDGET, over)
            return
        if self._max_context is not None:
            room = min(room, self._max_context - len(call.prompt_ids))
            if room < 1:
                self._fail(
                    ep.group,
                    GroupReason.AGENT_CONTEXT_TOO_LONG,
                    f"a prompt of {len(call.prompt_ids)} tokens leaves no room within the "
                    f"{self._max_context} positions",
                )
                return
        ep.context, ep.call = call.prompt_ids, call
        ep.params = self._sampling.model_copy(update={"max_new_tokens": room})
        self._make_ready(ep)

    def _turn_fits(self, ep: _Episode, observed: int) -> bool:
        """Whether a turn after `observed` more tokens stays within `max_context`."""
        limit = self._max_context
        return limit is None or len(ep.context) + observed + self._sampling.max_new_tokens <= limit

    def _end_full(self, ep: _Episode, observed: int) -> None:
        """End `ep`, whose next turn `max_context` has no room for (see the class)."""
        self._close_env(ep)
        if ep.turns:
            ep.finish = "length"
            self._score(ep, partial(self._task.score, ep.group.item, ep.text))
            return
        self._fail(
            ep.group,
            GroupReason.CONTEXT_TOO_LONG,
            f"{len(ep.context) + observed} tokens of prompt and first observation and "
            f"{self._sampling.max_new_tokens} new ones pass the {self._max_context} positions",
        )

    def _make_ready(self, ep: _Episode) -> None:
        if not self._ready:
            self._ready_since = time.monotonic()
        self._ready.append(ep)

    def _to_env(self, calls: Sequence[tuple[_Episode, str | None]]) -> None:
        """Hand episodes to their environments: `reset` for None, else `step` of the text."""
        sent: list[Call[_Episode]] = []
        for ep, text in calls:
            assert ep.env is not None  # closed only once back from its environment
            sent.append((ep, ep.env, ep.group.item if text is None else text))
        self._envs.send(sent)

    def _close_env(self, ep: _Episode) -> None:
        if ep.env is not None:
            self._envs.close_env(ep.env)
            ep.env = None
