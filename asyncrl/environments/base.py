"""The environment seam: what one multi-turn episode talks to between the policy's turns.

Users implement `Environment` (three coroutines) and name the class by import path in
`task.environment` (`type: python`), or serve it with `asyncrl env-server` and point
`task.environment` (`type: remote`) at the servers; or they name tools the policy calls in its
output (`type: tools`, `asyncrl.environments.tools`). Each episode is one coroutine
(`asyncrl.episodes.environment`) on the rollout worker's event loop beside the generating
thread:

    obs = await env.reset(item)           # appended after the prompt (may be None)
    loop: policy turn → text
          result = await env.step(text)   # result.observation appended, until result.done
    await env.close()

Observations are rendered to token ids by the episode (`render_observation`), always with the
run's tokenizer, and join the response loss-masked. A failure of the environment's code, a call
past its timeout or a reply that does not fit this protocol raises `EnvironmentFailure` with a
stable reason; the episode's group then fails (dead letter, counted by reason), the worker goes
on.
"""

from __future__ import annotations

import asyncio
import math
import numbers
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from asyncrl.items import PromptItem
from asyncrl.reasons import ENV_REASONS, EnvReason

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

Observation = str | list[dict[str, str]] | None
"""Text appended as tokens of the tokenizer (special tokens written in it are parsed), or chat
messages (`{"role": ..., "content": ...}`) rendered with the tokenizer's chat template and its
generation prompt; None: nothing appended."""


@dataclass(frozen=True)
class StepResult:
    """What the environment answers to one policy turn."""

    observation: Observation
    """Appended to the context before the next turn (ignored once `done`)."""
    done: bool
    """The episode is over: no more turns."""
    reward: float | None = None
    """The episode's reward when done; None: scored by the task's reward on the last turn."""
    info: dict[str, Any] = field(default_factory=dict)
    """Free-form details (logged, not trained on). `tool_calls`, when present, maps outcomes
    of `asyncrl.reasons.ToolCallOutcome` to the turn's counts of them
    (`asyncrl_tool_calls_total`)."""


class Environment(Protocol):
    """One episode's environment. A fresh instance per episode (constructed with the
    configured `kwargs`); all methods are coroutines on the worker's event loop, so a tool
    awaits its I/O for as long as it takes while other episodes generate. Blocking work must go
    through `asyncio.to_thread`, or the environment out of process (`asyncrl env-server`): a
    call that blocks the loop stalls every episode of the worker and cannot be timed out."""

    async def reset(self, item: PromptItem) -> Observation:
        """Start the episode of `item`; the first observation after the prompt."""
        ...

    async def step(self, response: str) -> StepResult:
        """The policy's turn (decoded, special tokens removed)."""
        ...

    async def close(self) -> None:
        """Release what the episode holds; called once, whether it ended or failed."""
        ...


EnvironmentFactory = Callable[[PromptItem, str], Environment]
"""A fresh environment for one episode of an item; the second argument is the episode's id,
unique per episode."""


class EnvironmentFailure(Exception):
    """An environment call that gave nothing usable; `reason` is an `EnvReason` (a string read
    from an env-server is checked against `ENV_REASONS` first)."""

    def __init__(self, reason: str, detail: str) -> None:
        assert reason in ENV_REASONS, reason
        super().__init__(f"env_{reason}: {detail}")
        self.reason = reason
        self.detail = detail


class Escaped(Exception):
    """A BaseException that is not an Exception (SystemExit, KeyboardInterrupt, GeneratorExit,
    a CancelledError nobody asked for, one of its own), raised by user code and carried as an
    Exception, so that it fails only the call that raised it."""

    def __init__(self, exc: BaseException) -> None:
        super().__init__(f"{type(exc).__name__}: {exc}")


def describe(exc: BaseException) -> str:
    """What a failure of user code says in a dead letter (an `Escaped` says its own type)."""
    return str(exc) if isinstance(exc, Escaped) else f"{type(exc).__name__}: {exc}"


T = TypeVar("T")


def cancelled_by_request() -> bool:
    """Whether the running task was asked to cancel: its CancelledError is not user code's."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


async def contained(call: Awaitable[T]) -> T:
    """`await call`, any BaseException it raises but a requested cancellation turned into
    `Escaped`. Where a task runs user code, this keeps it inside: asyncio re-raises SystemExit
    and KeyboardInterrupt from a task out of the event loop, which ends the loop's thread (and
    with it every episode of the worker), and a CancelledError of the code's own would pass
    for the caller being cancelled."""
    try:
        return await call
    except Exception:
        raise
    except BaseException as exc:
        if isinstance(exc, asyncio.CancelledError) and cancelled_by_request():
            raise
        raise Escaped(exc) from exc  # the cause keeps where user code raised it


def malformed(detail: str) -> EnvironmentFailure:
    return EnvironmentFailure(EnvReason.MALFORMED, detail)


def check_observation(obs: object) -> Observation:
    """`obs` if it is an `Observation`, else a malformed failure."""
    if obs is None or isinstance(obs, str):
        return obs
    if isinstance(obs, list) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
        for m in obs
    ):
        return obs
    raise malformed(f"observation {obs!r:.200}: expected text, chat messages or None")


def check_step(result: object) -> StepResult:
    """`result` if it is a well-formed `StepResult`, else a malformed failure."""
    if not isinstance(result, StepResult):
        raise malformed(f"step returned {type(result).__name__}, not a StepResult")
    if not isinstance(result.done, bool):
        raise malformed(f"done={result.done!r}: expected a bool")
    reward = result.reward
    if reward is not None and (
        isinstance(reward, bool)
        or not isinstance(reward, numbers.Real)
        or not math.isfinite(reward)
    ):
        raise malformed(f"reward={reward!r}: expected a finite number or None")
    check_observation(result.observation)
    return result


async def reset_checked(env: Environment, item: PromptItem) -> Observation:
    """`env.reset(item)`, what it raises contained (`contained`), its reply checked against the
    protocol."""
    return check_observation(await contained(env.reset(item)))


async def step_checked(env: Environment, response: str) -> StepResult:
    """`env.step(response)`, contained, its reply checked against the protocol."""
    return check_step(await contained(env.step(response)))


# Stands for an assistant turn's content where `render_observation` cuts the template open.
_MARK = "\x00asyncrl-assistant\x00"


def render_prompt(
    tokenizer: PreTrainedTokenizerBase,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
    **template_kwargs: Any,
) -> list[int]:
    """Token ids of a conversation's start through the chat template, the generation prompt
    added; `tools` (JSON schemas) go where the template puts them (Qwen: the system turn);
    `template_kwargs` are the template's own variables (Qwen3's `enable_thinking`)."""
    # As transformers types `tools=` (it also takes functions, which it makes schemas of).
    schemas: list[dict[Any, Any] | Callable[..., Any]] | None = None if tools is None else [*tools]
    text = tokenizer.apply_chat_template(
        messages, tools=schemas, tokenize=False, add_generation_prompt=True, **template_kwargs
    )
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def render_observation(
    tokenizer: PreTrainedTokenizerBase, obs: Observation, ended_by: int | None = None
) -> list[int]:
    """Token ids of an observation after a policy turn: text as the tokenizer reads it (no
    special tokens added); chat messages as what the chat template renders after an assistant
    turn when the whole conversation is rendered: the end of that turn, the messages, the next
    generation prompt. `ended_by` is the token that ended the turn (an end of turn the context
    holds already, left out here); None when the turn was cut by the token limit, and the
    template's end of turn is supplied. After the prompt, before any turn, chat messages follow
    an empty assistant turn.

    The template renders a placeholder conversation (a user turn, an assistant turn, then the
    messages), cut after the assistant's content: messages alone would render differently
    (Qwen2.5 puts a default system turn first), and what precedes them may depend on what
    follows (Qwen3 adds an empty `<think>` block only to a final assistant turn).
    """
    if obs is None:
        return []
    if isinstance(obs, str):
        return list(tokenizer(obs, add_special_tokens=False)["input_ids"])
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "?"}, {"role": "assistant", "content": _MARK}, *obs],
        tokenize=False,
        add_generation_prompt=True,
    )
    _, mark, after = str(text).partition(_MARK)
    if not mark:
        raise ValueError("the chat template drops the content of an assistant turn")
    ids = list(tokenizer(after, add_special_tokens=False)["input_ids"])
    return ids[1:] if ended_by is not None and ids[:1] == [ended_by] else ids
