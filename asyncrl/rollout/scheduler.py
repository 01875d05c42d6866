"""Episodes in flight, kept as groups (a prompt's n episodes): waiting on environments and
agents never idles the engine. `start` begins a group: one-turn episodes (a plain `Task`) as
turns of the generating thread alone (one generate, one score, inline, no event loop), others
as coroutines of their kind (`EpisodeKind`: `asyncrl.episodes.environment`,
`asyncrl.agents.episode`) on the environments' loop (`env_loop`), awaiting their turns from the
batcher (`turns`; their scores come from a thread of their own). `advance` takes back what the
loop handed over (turns, ended episodes), makes one engine call per sampling over the ready
turns (which wait up to `batch_wait_s` for episodes away, to share it) and hands back the
groups that ended.

The rule, kept by every `advance`:

    Every group `start`ed is handed back once: finished (its samples, one list per episode in
    episode order, made into the group by its kind), or failed under one reason (a
    `GroupReason` value, or `STALE`): the first failure of any of its episodes, whose other
    episodes are cancelled at once. It counts in `inflight` until it is handed back, so a
    caller that advances while episodes are in flight gets it. `close` hands back none: the
    groups in flight then stay pending in the queue.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Generic, TypeVar, cast

from asyncrl.engines.base import Generation, RolloutEngine
from asyncrl.engines.config import SamplingParams
from asyncrl.environments.base import EnvironmentFailure, describe
from asyncrl.episodes.base import EpisodeFailed, EpisodeKind, too_long
from asyncrl.episodes.environment import EnvironmentEpisodes
from asyncrl.episodes.record import one_turn_sample
from asyncrl.items import PromptItem
from asyncrl.metrics.breakdown import phase
from asyncrl.protocol import Sample
from asyncrl.reasons import GroupReason
from asyncrl.rollout.env_loop import EnvironmentLoop
from asyncrl.rollout.groups import STALE, FailedGroup, FinishedGroup, Group
from asyncrl.rollout.turns import (
    EpisodeTurns,
    GenerateCall,
    Scorer,
    Turn,
    TurnBatcher,
    answer,
    score,
)
from asyncrl.tasks.base import EpisodicTask, Task

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

T = TypeVar("T")
log = logging.getLogger(__name__)

_Key = tuple[Group[Any], int]  # an episode: its group, its index there


class EpisodeScheduler(Generic[T]):
    """Runs the episodes of started groups; one thread (the caller's) drives generation."""

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
        kind: EpisodeKind | None = None,
    ) -> None:
        """`kind`: the episodes' when not the task's own (an agent's); None: an environment's
        for an `EpisodicTask`, else one turn."""
        self._task, self._tokenizer = task, tokenizer
        self._sampling, self._max_context = sampling, max_context  # every turn's bounds
        self._batch_wait_s = batch_wait_s
        self._on_env_error = on_env_error
        self._envs: EnvironmentLoop[_Key] = EnvironmentLoop()
        self._scorer = Scorer(task)
        self._turns: TurnBatcher[_Key] = TurnBatcher(engine, on_generate)
        self._kind = kind
        if kind is None and isinstance(task, EpisodicTask):
            self._kind = EnvironmentEpisodes(
                task.environment, tokenizer, self._envs.close_env, on_tool_calls
            )
        self._groups: list[Group[T]] = []
        self._failed: list[FailedGroup[T]] = []
        self._running = 0  # episodes on the loop that have not ended, of groups not failed
        self.inflight = 0

    @property
    def tokens(self) -> int:  # generated so far (observations not counted)
        return self._turns.tokens

    def start(self, tag: T, item: PromptItem, n: int, episode_prefix: str) -> None:
        """Begin the n episodes of `item`, episode i as `{episode_prefix}/{i}`."""
        group: Group[T] = Group(tag, item, [None] * n, time.time())
        self._groups.append(group)
        self.inflight += n
        for i in range(n):
            if self._kind is None:
                tokens, limit = len(item.prompt_ids), self._max_context
                if limit is not None and tokens + self._sampling.max_new_tokens > limit:
                    self._fail_by(group, too_long(tokens, self._sampling.max_new_tokens, limit))
                    return
                self._turns.add(Turn((group, i), item.prompt_ids, self._sampling))
                continue
            turns = EpisodeTurns(
                (group, i), item, self._envs, self._scorer, self._sampling, self._max_context
            )
            try:
                episode = self._kind.episode(turns, item, f"{episode_prefix}/{i}")
            except KeyboardInterrupt:  # Ctrl-C arrives so on this thread: not the task's
                raise
            except BaseException as exc:  # e.g. an answer the task cannot parse, a sys.exit()
                self._fail(group, GroupReason.TASK_ERROR, describe(exc))
                return
            group.episodes.append(self._envs.spawn((group, i), episode))
            group.running += 1
            self._running += 1

    def advance(self, wait_s: float) -> tuple[list[FinishedGroup[T]], list[FailedGroup[T]]]:
        """Take back what the episodes handed over (waiting up to `wait_s` when no turn is
        ready), generate every ready turn, return the groups that ended since the last call."""
        with phase("env"):
            self._take(0.0 if self._turns.ready else wait_s)
            # Every generate call pays its decode steps' fixed overhead once, so ready turns
            # wait a little for episodes coming back from their environments to share one.
            deadline = self._turns.since + self._batch_wait_s
            while self._turns.ready and self._away() and (left := deadline - time.monotonic()) > 0:
                self._take(left)
        if self._turns.ready:
            self._generate()
        finished: list[FinishedGroup[T]] = []
        for g in self._groups:
            if not g.failed and g.done:
                samples = [s for ep in g.samples if ep is not None for s in ep]
                try:
                    item, samples = (
                        self._kind.group(g.item, samples) if self._kind else (g.item, samples)
                    )
                except EpisodeFailed as exc:
                    self._fail_by(g, exc)
                    continue
                finished.append(FinishedGroup(g.tag, item, samples, g.created_at))
        # A failed group counts in flight until it is handed back (see the module's rule).
        ended = [g for g in self._groups if g.failed or g.done]
        self.inflight -= sum(len(g.samples) for g in ended)
        self._groups = [g for g in self._groups if not (g.failed or g.done)]
        failed, self._failed = self._failed, []
        return finished, failed

    def drop_older_than(self, version: int) -> None:
        """Give up every group holding a token older than `version` (the engine's − η: each
        would be dropped stale), handed back failed as `STALE`: its episodes stop costing
        generation and environment time (a long multi-turn tail's most of all)."""
        for g in self._groups:
            if not g.failed and not g.done and g.oldest is not None and g.oldest < version:
                self._fail(g, STALE, f"oldest token of version {g.oldest}, bound {version}")

    def close(self) -> None:
        """End what the episodes share (an agent's sessions: no call waits on a scheduler that
        is gone), then cancel the episodes in flight: their environments close (sessions on an
        env-server are deleted), best effort within a few seconds; the loop thread ends."""
        if self._kind is not None:
            self._kind.close()
        self._envs.close()
        self._scorer.close()

    def _away(self) -> int:
        """Episodes whose turn may come back soon: at their environments, or agents without a
        call ready."""
        return self._running - sum(t.future is not None for t in self._turns.ready)

    def _take(self, wait_s: float) -> None:
        for (group, index), what in self._envs.take_back(wait_s):
            if isinstance(what, Turn):
                if not group.failed:
                    self._turns.add(what)
            elif not group.failed:  # an episode ended
                group.running -= 1
                self._running -= 1
                if isinstance(what, Exception):
                    self._fail_by(group, what)
                else:
                    group.samples[index] = cast("list[Sample]", what)

    def _generate(self) -> None:
        got = self._turns.run()
        for turn, gen in got:  # failures first: the turns of a failed group go unanswered
            if isinstance(gen, EpisodeFailed):
                self._fail_by(turn.key[0], gen)
        done = [(t, g) for t, g in got if isinstance(g, Generation) and not t.key[0].failed]
        for turn, gen in done:
            turn.key[0].saw(gen.versions)
        answer(self._envs, [(t.future, g) for t, g in done if t.future is not None])
        if inline := [(t, g) for t, g in done if t.future is None]:
            self._one_turns(inline)

    def _one_turns(self, done: list[tuple[Turn[_Key], Generation]]) -> None:
        """The end of one-turn episodes: each response decoded and scored, inline."""
        try:
            texts = self._tokenizer.batch_decode(
                [g.token_ids.tolist() for _, g in done], skip_special_tokens=True
            )
        except Exception as exc:  # tokens the tokenizer does not know came out of the engine
            log.exception("decoding %d response(s) failed", len(done))
            for turn, _ in done:
                self._fail(turn.key[0], GroupReason.ENGINE_ERROR, describe(exc))
            return
        for (turn, gen), text in zip(done, texts, strict=True):
            group, index = turn.key
            if group.failed:  # a sibling's score failed just now
                continue
            try:
                with phase("env"):
                    reward = score(self._task, group.item, text)
            except EpisodeFailed as exc:
                self._fail_by(group, exc)
                continue
            group.samples[index] = [one_turn_sample(len(group.item.prompt_ids), gen, reward)]

    def _fail_by(self, group: Group[T], exc: Exception) -> None:
        """Fail `group` by what an episode of it raised."""
        if isinstance(exc, EnvironmentFailure):
            if self._on_env_error is not None and not group.failed:
                self._on_env_error(exc.reason)
            exc = EpisodeFailed(f"env_{exc.reason}", exc.detail)
        elif not isinstance(exc, EpisodeFailed):  # the episode's own code: a bug
            log.error("an episode failed", exc_info=exc)
            exc = EpisodeFailed(GroupReason.TASK_ERROR, describe(exc))
        self._fail(group, exc.reason, exc.detail)

    def _fail(self, group: Group[T], reason: str, detail: str) -> None:
        if group.failed:
            return
        group.failed = True
        self._failed.append(FailedGroup(group.tag, reason, detail))
        self._running -= group.running
        group.running = 0
        self._turns.discard(lambda key: key[0] is group)
        self._envs.cancel(group.episodes, f"its group failed ({reason})")
