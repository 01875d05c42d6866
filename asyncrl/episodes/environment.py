"""An environment episode, top to bottom: reset → generate → step → render, until the
environment says done, the context is full, or a call fails.

Every call runs on the environments' event loop (a tool awaits its I/O, so a waiting episode
costs a timer, not a thread); generation is awaited from the rollout side's turn batcher
(`Turns`), which batches this turn with every other episode's. Observations are rendered to
token ids here, with the run's tokenizer, and join the response loss-masked (`TokenRecord`).
When `step` gives no reward, the task scores the last turn. The environment is closed when the
episode ends, however it ends (its group failed and it was cancelled included), by a task of
its own: a close that hangs holds no group back.

Failures end the group: an environment call's (`EnvironmentFailure`, whatever it raised:
`env_{reason}`), an observation the tokenizer cannot render (`env_malformed`), a first turn
past the context bound (`context_too_long`). A later turn past it ends the episode as
truncated (finish `length`, scored by the task on its last turn) before its observation is
prefilled: the model never runs, nor is a sample trained, at positions it does not have.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from asyncrl.environments.base import (
    Environment,
    EnvironmentFactory,
    EnvironmentFailure,
    Observation,
    StepResult,
    describe,
    render_observation,
    reset_checked,
    step_checked,
)
from asyncrl.environments.tools import tool_call_counts
from asyncrl.episodes.base import EpisodeFailed, Turns, fits, too_long
from asyncrl.episodes.record import TokenRecord
from asyncrl.reasons import EnvReason, GroupReason

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from asyncrl.items import PromptItem
    from asyncrl.protocol import Sample

R = TypeVar("R")


@dataclass(frozen=True)
class EnvironmentEpisodes:
    """The episodes of a task with an environment per episode (`environments`)."""

    environments: EnvironmentFactory
    tokenizer: PreTrainedTokenizerBase
    close_env: Callable[[Environment], None]
    """Closes an environment on a task of its own (the loop's, so that its close waits)."""
    on_tool_calls: Callable[[str, int], None] | None = None

    def episode(
        self, turns: Turns, item: PromptItem, episode_id: str
    ) -> Coroutine[Any, Any, list[Sample]]:
        return self._run(turns, self.environments(item, episode_id), item)

    def group(self, item: PromptItem, samples: list[Sample]) -> tuple[PromptItem, list[Sample]]:
        return item, samples

    def close(self) -> None:
        return

    async def _run(self, turns: Turns, env: Environment, item: PromptItem) -> list[Sample]:
        record = TokenRecord(item.prompt_ids)
        reward: float | None = None
        text = ""
        try:
            observation = self._render(await _env(reset_checked(env, item)), None)
            while fits(turns, len(record.context) + len(observation)):
                record.observe(observation)
                gen = await turns.generate(record.context)
                text = self._decode(gen.token_ids.tolist())
                record.add_turn(gen)
                result = await _env(step_checked(env, text))
                self._count_tool_calls(result)
                if result.done:
                    reward = result.reward
                    break
                observation = self._render(result.observation, record.ended_by)
            else:  # the next turn would pass the context bound
                if not record.turns:
                    sampling = turns.sampling
                    tokens = len(record.context) + len(observation)
                    raise too_long(tokens, sampling.max_new_tokens, turns.max_context)
                record.finish = "length"
        finally:
            self.close_env(env)
        if reward is None:  # the environment leaves the reward to the task's score
            reward = await turns.score(text)
        return [record.sample(reward, {"turns": len(record.turns)})]

    def _render(self, obs: Observation, ended_by: int | None) -> list[int]:
        try:
            return render_observation(self.tokenizer, obs, ended_by)
        except Exception as exc:  # chat messages for a tokenizer without a template
            raise EpisodeFailed(
                GroupReason.ENV_MALFORMED, f"rendering {obs!r:.200}: {exc}"
            ) from exc

    def _decode(self, ids: list[int]) -> str:
        try:
            return str(self.tokenizer.decode(ids, skip_special_tokens=True))
        except Exception as exc:  # tokens the tokenizer does not know came out of the engine
            raise EpisodeFailed(GroupReason.ENGINE_ERROR, describe(exc)) from exc

    def _count_tool_calls(self, result: StepResult) -> None:
        if self.on_tool_calls is not None:
            for outcome, n in tool_call_counts(result.info):
                self.on_tool_calls(outcome, n)


async def _env(call: Awaitable[R]) -> R:
    """An environment call's value; whatever it raised as an `EnvironmentFailure` (but a
    failure that fails its group by its own reason, such as a reward the tool computed)."""
    try:
        return await call
    except (EnvironmentFailure, EpisodeFailed):
        raise
    except Exception as exc:  # `contained` made any BaseException of its code an Exception
        raise EnvironmentFailure(EnvReason.ERROR, describe(exc)) from exc
