"""The turn batcher: every turn any episode awaits, generated in batches on the generating thread.

An episode on the environments' loop awaits `EpisodeTurns.generate`: its `Turn` goes to the
generating thread (`EnvironmentLoop.post`) and waits on a future of the loop (its score, where
the task gives it, goes to a thread of its own: `Scorer`). The generating
thread `add`s the turns that came, and `run` makes one engine call per sampling — the same
`max_new_tokens` and stop ids (an agent's call may bound its tokens) — over all of them; what
each call generated goes back to its episodes' futures in one wakeup of the loop (`answer`), as
the gateway's calls wait on their sessions. A one-turn episode's turn is `add`ed on this thread
and answered here (no future: the scheduler finishes it inline).

Every generated turn passes here, in order, with its episode's key: the place to journal a
completed turn, and to hand a resumed episode the turns it already has.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Generic, TypeVar

from asyncrl.engines.base import EngineError, Generation, RolloutEngine
from asyncrl.engines.config import SamplingParams
from asyncrl.environments.base import describe
from asyncrl.episodes.base import EpisodeFailed
from asyncrl.metrics.breakdown import phase
from asyncrl.reasons import GroupReason
from asyncrl.rollout.env_loop import EnvironmentLoop

if TYPE_CHECKING:
    from asyncrl.items import PromptItem
    from asyncrl.tasks.base import Task

K = TypeVar("K")
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


@dataclass(eq=False)
class Turn(Generic[K]):
    """One turn waiting for the engine."""

    key: K
    """Whose turn: the scheduler's episode."""
    context: list[int]
    params: SamplingParams
    future: asyncio.Future[Generation] | None = None
    """The episode awaiting it on the loop; None: answered on the generating thread."""


Generated = Generation | EpisodeFailed
"""What a turn got: its generation, or the failure that ends its group."""


class TurnBatcher(Generic[K]):
    """The turns ready for the engine (generating thread only)."""

    def __init__(
        self, engine: RolloutEngine, on_generate: Callable[[GenerateCall], None] | None = None
    ) -> None:
        self._engine = engine
        self._on_generate = on_generate
        self.ready: list[Turn[K]] = []
        self.since = 0.0
        """When the oldest ready turn came (monotonic)."""
        self.tokens = 0
        """Tokens generated so far (observations not counted)."""

    def add(self, turn: Turn[K]) -> None:
        if not self.ready:
            self.since = time.monotonic()
        self.ready.append(turn)

    def discard(self, gone: Callable[[K], bool]) -> None:
        """Drop the ready turns whose episodes are `gone` (their group failed)."""
        self.ready = [t for t in self.ready if not gone(t.key)]

    def run(self) -> list[tuple[Turn[K], Generated]]:
        """Generate every ready turn: one engine call per sampling."""
        batch, self.ready = self.ready, []
        parts: dict[tuple[int, tuple[int, ...] | None], list[Turn[K]]] = {}
        for turn in batch:
            parts.setdefault((turn.params.max_new_tokens, turn.params.stop_token_ids), []).append(
                turn
            )
        return [done for part in parts.values() for done in self._call(part)]

    def _call(self, turns: list[Turn[K]]) -> list[tuple[Turn[K], Generated]]:
        t0 = time.monotonic()
        got: list[Generated]
        try:
            with phase("generate"):
                got = list(self._engine.generate([t.context for t in turns], turns[0].params))
            if len(got) != len(turns):
                raise RuntimeError(f"{len(got)} generations for {len(turns)} prompts")
        except EngineError as exc:
            failed = f"engine_{exc.reason}"
            partial = exc.generations or [None] * len(turns)
            got = [g or EpisodeFailed(failed, exc.detail) for g in partial]
        except Exception as exc:
            # Not one of the engine's own failures: a bug, or input it chokes on. Which prompt
            # caused it is unknown, so the whole call's groups fail (dead-lettered, counted);
            # the worker goes on with the rest.
            log.exception("generate failed for %d episode(s)", len(turns))
            got = [EpisodeFailed(GroupReason.ENGINE_ERROR, describe(exc)) for _ in turns]
        done = [(t, g) for t, g in zip(turns, got, strict=True) if isinstance(g, Generation)]
        tokens = sum(len(g.token_ids) for _, g in done)
        self.tokens += tokens
        if self._on_generate is not None:
            self._on_generate(
                GenerateCall(
                    seconds=time.monotonic() - t0,
                    response_tokens=tokens,
                    prompt_tokens=sum(len(t.context) for t, _ in done),
                    cached_tokens=sum(g.cached_tokens for _, g in done),
                )
            )
        return list(zip(turns, got, strict=True))


def answer(
    loop: EnvironmentLoop[K], answers: Sequence[tuple[asyncio.Future[T], T | Exception]]
) -> None:
    """Hand each value (or failure) to the episode awaiting it, in one wakeup of the loop."""
    if answers:
        loop.call_soon(_resolve, answers)


def _resolve(answers: Sequence[tuple[asyncio.Future[T], T | Exception]]) -> None:
    for future, got in answers:
        if future.done():  # its episode was cancelled meanwhile
            continue
        if isinstance(got, Exception):
            future.set_exception(got)
        else:
            future.set_result(got)


def score(task: Task, item: PromptItem, text: str) -> float:
    """The task's score of `text`; its code's failure as `EpisodeFailed`: a reward's by its own
    reason, anything else (a `sys.exit()` too) as `task_error`."""
    try:
        return task.score(item, text)
    except EpisodeFailed as exc:  # the user's reward, isolated: its own reason, no trace here
        log.warning("reward failed: %s", exc)
        raise
    except KeyboardInterrupt:  # Ctrl-C arrives so on this thread: not the task's
        raise
    except BaseException as exc:
        log.exception("scoring an episode failed")
        raise EpisodeFailed(GroupReason.TASK_ERROR, describe(exc)) from exc


class Scorer:
    """The task's scores of episodes' last answers, one at a time on a thread of their own: the
    loop never blocks on a reward, and an episode's end never waits for a generate call."""

    def __init__(self, task: Task) -> None:
        self._task = task
        self._thread: ThreadPoolExecutor | None = None

    async def __call__(self, item: PromptItem, text: str) -> float:
        if self._thread is None:
            self._thread = ThreadPoolExecutor(1, thread_name_prefix="score")
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._thread, score, self._task, item, text)

    def close(self) -> None:
        if self._thread is not None:
            self._thread.shutdown(wait=False, cancel_futures=True)


class EpisodeTurns(Generic[K]):
    """One episode's `Turns` (`asyncrl.episodes.base`): its turns go to the generating thread
    with its key, its score to the scorer."""

    def __init__(
        self,
        key: K,
        item: PromptItem,
        loop: EnvironmentLoop[K],
        scorer: Scorer,
        sampling: SamplingParams,
        max_context: int | None,
    ) -> None:
        self._key, self._item = key, item
        self._loop, self._scorer = loop, scorer
        self.sampling = sampling
        self.max_context = max_context

    async def generate(
        self, context: list[int], params: SamplingParams | None = None
    ) -> Generation:
        future: asyncio.Future[Generation] = asyncio.get_running_loop().create_future()
        self._loop.post(self._key, Turn(self._key, context, params or self.sampling, future))
        return await future

    async def score(self, text: str) -> float:
        return await self._scorer(self._item, text)
