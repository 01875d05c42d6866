"""Tool calls in model output: the Hermes/Qwen format, tools by import path, `ToolEnvironment`.

The format is the one Qwen2.5 and Qwen3 chat templates teach when given `tools=`: the tools'
JSON schemas go into the system turn inside `<tools></tools>`, and the model calls one with a
JSON object inside `<tool_call></tool_call>`, as many as it likes in one turn, text around them
allowed::

    I'll add them first.
    <tool_call>
    {"name": "add", "arguments": {"a": 12, "b": 34}}
    </tool_call>

Each call's result goes back as a chat message `{"role": "tool", "content": "46"}`, which those
templates render as a user turn holding `<tool_response>\\n46\\n</tool_response>`. A call that
cannot run is answered too, with an error the model can read (`error: unknown tool 'mul';
available: add`), and counted by reason (`CallError.reason`, an `asyncrl.reasons`
`ToolCallOutcome`: `malformed_json`, `bad_call`, `unclosed_call`, `unknown_tool`,
`bad_arguments`, `too_many_calls`, `tool_error`, `tool_timeout`, and `tool_busy` for a sync
tool whose threads are all held by calls that have not returned; `SyncThreads`). A bad call
never fails the episode: telling the model is what trains it.

A turn without a call is the final answer: the episode ends, scored by the task's reward
(`StepResult.reward` None). Each turn's calls are counted by outcome (`ok` or the reason) in
`StepResult.info["tool_calls"]`, which the rollout worker adds to `asyncrl_tool_calls_total`.

The episode's prompt (`tool_prompt`) is the item's prompt as a user turn, after the configured
system prompt, rendered with the tools' schemas; `reset` adds nothing to it. Observations are
rendered like every chat observation (`asyncrl.environments.base.render_observation`), so the
tokens of prompt, turns and tool results are exactly the template's rendering of the whole
conversation.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import logging
import re
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from asyncrl.environments.base import (
    EnvironmentFactory,
    Escaped,
    StepResult,
    contained,
    render_prompt,
)
from asyncrl.plugins import load_object
from asyncrl.reasons import TOOL_CALL_OUTCOMES, ToolCallOutcome

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from asyncrl.environments.config import ToolEnvironmentConfig
    from asyncrl.items import PromptItem

log = logging.getLogger(__name__)

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_CALL = re.compile(re.escape(OPEN) + r"(.*?)" + re.escape(CLOSE), re.DOTALL)
_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "array": (list,),
    "object": (dict,),
    "null": (type(None),),
}

Messages = list[dict[str, str]]


@dataclass(frozen=True)
class ToolCall:
    """One well-formed call: a tool's name and its arguments as the model wrote them."""

    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class CallError:
    """A call that did not run (or failed): `reason` is a stable code, `message` what the model
    is told."""

    reason: ToolCallOutcome
    message: str


def tool_call_counts(info: dict[str, Any]) -> list[tuple[str, int]]:
    """(outcome, count) of a step's `info["tool_calls"]`, which any environment may report (a
    served one through JSON): outcomes outside `TOOL_CALL_OUTCOMES` and counts that are no
    positive integers are left out, so that counting cannot fail a worker."""
    calls = info.get("tool_calls")
    if not isinstance(calls, dict):
        return []
    return [
        (k, n)
        for k, n in calls.items()
        if k in TOOL_CALL_OUTCOMES and isinstance(n, int) and not isinstance(n, bool) and n > 0
    ]


def parse_tool_calls(text: str) -> list[ToolCall | CallError]:
    """The calls of one response, in order; [] when it makes none (its final answer).

    >>> parse_tool_calls('x <tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>')
    [ToolCall(name='add', arguments={'a': 1})]
    """
    calls: list[ToolCall | CallError] = [_parse_one(m.group(1)) for m in _CALL.finditer(text)]
    if OPEN in _CALL.sub("", text):
        calls.append(CallError(ToolCallOutcome.UNCLOSED_CALL, f"error: {OPEN} without {CLOSE}"))
    return calls


def _parse_one(body: str) -> ToolCall | CallError:
    try:
        call = json.loads(body)
    except json.JSONDecodeError as exc:
        return CallError(
            ToolCallOutcome.MALFORMED_JSON, f"error: the tool call is not valid JSON ({exc.msg})"
        )
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return CallError(
            ToolCallOutcome.BAD_CALL, 'error: expected {"name": <tool name>, "arguments": {...}}'
        )
    arguments = call.get("arguments", {})
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        with contextlib.suppress(json.JSONDecodeError):
            arguments = json.loads(arguments)
    if not isinstance(arguments, dict):
        return CallError(ToolCallOutcome.BAD_ARGUMENTS, "error: arguments must be a JSON object")
    return ToolCall(call["name"], arguments)


def tool_schema(fn: Callable[..., Any]) -> dict[str, Any]:
    """The tool's JSON schema in the `{"type": "function", "function": {...}}` shape chat
    templates take: from its type hints and its docstring's `Args:` section (transformers'
    `get_json_schema`, which names what is missing when it cannot)."""
    from transformers.utils import get_json_schema

    return get_json_schema(fn)


@dataclass(frozen=True)
class Tool:
    """A callable the model may call, with the schema it is shown."""

    fn: Callable[..., Any]
    schema: dict[str, Any]

    @property
    def name(self) -> str:
        return str(self.schema["function"]["name"])

    def check(self, arguments: dict[str, Any]) -> str | None:
        """Why `arguments` do not fit the schema (missing, unknown or mistyped), else None."""
        params = self.schema["function"].get("parameters", {})
        properties: dict[str, Any] = params.get("properties", {})
        missing = [p for p in params.get("required", []) if p not in arguments]
        if missing:
            return f"missing argument(s) {', '.join(missing)}"
        unknown = [a for a in arguments if a not in properties]
        if unknown:
            return f"unknown argument(s) {', '.join(unknown)}; takes {', '.join(properties)}"
        for name, value in arguments.items():
            if not _fits(value, properties[name]):
                return f"argument {name}={json.dumps(value)} does not fit {properties[name]}"
        return None


def _fits(value: Any, prop: dict[str, Any]) -> bool:
    if "enum" in prop and value not in prop["enum"]:
        return False
    kinds = prop.get("type")
    if kinds is None:
        return True
    kinds = [kinds] if isinstance(kinds, str) else kinds
    # A JSON true is no integer, though Python's bool is an int.
    return any(
        isinstance(value, _JSON_TYPES.get(k, (object,)))
        and not (k in ("integer", "number") and isinstance(value, bool))
        for k in kinds
    )


def load_tools(paths: list[str], python_path: list[str]) -> dict[str, Tool]:
    """The tools named by import path, by name; ValueError naming `environment.tools[i]` when
    one has no usable schema."""
    tools: dict[str, Tool] = {}
    for i, path in enumerate(paths):
        fn = load_object(path, python_path)
        try:
            tool = Tool(fn, tool_schema(fn))
        except Exception as exc:  # transformers' parsing errors share no base class
            raise ValueError(f"environment.tools[{i}] {path!r}: no JSON schema: {exc}") from None
        tools[tool.name] = tool
    return tools


class Busy(Exception):
    """Every thread of a sync tool is taken: the call was not run."""


class SyncThreads:
    """Runs the calls of one sync tool, each on a daemon thread of its own, at most `limit` at
    once; a call beyond that is refused at once (`Busy`) rather than queued to time out.

    A sync call past its timeout cannot be stopped: its thread runs on and keeps its place
    until the function returns. Places are per tool, so hung calls of one tool use up that
    tool's places only (the default executor, shared by every tool and sized by the CPU count,
    was filled by six), and `running` counts them. Daemon threads: a call that never returns
    does not hold up the worker's exit."""

    def __init__(self, name: str, limit: int) -> None:
        self.name = name
        self.limit = limit
        self.running = 0
        """Calls whose function has not returned, hung ones included."""
        self._lock = threading.Lock()

    async def call(self, fn: Callable[..., Any], arguments: dict[str, Any]) -> Any:
        with self._lock:
            if self.running >= self.limit:
                raise Busy(f"all {self.limit} of its threads are held by calls not returned")
            self.running += 1
            full = self.running == self.limit
        if full:
            log.warning(
                "tool %s: all %d threads busy (calls past their timeout keep theirs); further "
                "calls answer tool_busy until one returns",
                self.name,
                self.limit,
            )
        loop = asyncio.get_running_loop()
        result: asyncio.Future[Any] = loop.create_future()
        threading.Thread(
            target=self._run,
            args=(loop, result, fn, arguments),
            name=f"tool-{self.name}",
            daemon=True,
        ).start()
        return await result

    def _run(
        self,
        loop: asyncio.AbstractEventLoop,
        result: asyncio.Future[Any],
        fn: Callable[..., Any],
        arguments: dict[str, Any],
    ) -> None:
        try:
            outcome: tuple[bool, Any] = (True, fn(**arguments))
        except BaseException as exc:  # a tool's sys.exit() ends its call, nothing else
            outcome = (False, exc if isinstance(exc, Exception) else Escaped(exc))
        finally:
            with self._lock:
                self.running -= 1
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits any more
            loop.call_soon_threadsafe(_settle, result, outcome)


def _settle(result: asyncio.Future[Any], outcome: tuple[bool, Any]) -> None:
    if result.done():  # the call timed out meanwhile
        return
    ok, value = outcome
    if ok:
        result.set_result(value)
    else:
        result.set_exception(value)


class ToolEnvironment:
    """One episode with tools (an `Environment`); its prompt comes from `tool_prompt`.

    Each `step` runs the turn's calls concurrently, each bounded by `timeout_s` (a sync tool on
    its `SyncThreads`), and answers with one `tool` message per call, in order; its
    `info["tool_calls"]` counts that turn's calls by outcome. `calls` (calls that ran and
    returned) and `errors` (by reason) add up the episode.
    """

    def __init__(
        self, cfg: ToolEnvironmentConfig, tools: dict[str, Tool], threads: dict[str, SyncThreads]
    ) -> None:
        self._cfg = cfg
        self._tools = tools
        self._threads = threads
        self.turns = 0
        self.calls = 0
        self.errors: Counter[str] = Counter()

    async def reset(self, item: PromptItem) -> None:
        """Nothing after the prompt: `tool_prompt` made it, tools included."""

    async def step(self, response: str) -> StepResult:
        self.turns += 1
        calls = parse_tool_calls(response)
        if not calls or self.turns >= self._cfg.max_turns:
            return StepResult(None, True, None, {"ended": "answer" if not calls else "max_turns"})
        limit = self._cfg.max_calls_per_turn
        over = CallError(
            ToolCallOutcome.TOO_MANY_CALLS, f"error: at most {limit} tool calls per turn; not run"
        )
        results = await asyncio.gather(
            *(self._run(c) for c in calls[:limit]), *(_done(over) for _ in calls[limit:])
        )
        outcomes = Counter(
            r.reason if isinstance(r, CallError) else ToolCallOutcome.OK for r in results
        )
        self.calls += outcomes[ToolCallOutcome.OK]
        self.errors.update({k: n for k, n in outcomes.items() if k != ToolCallOutcome.OK})
        messages = [{"role": "tool", "content": self._content(r)} for r in results]
        return StepResult(messages, False, None, {"tool_calls": dict(outcomes)})

    async def close(self) -> None:
        """Nothing held: tools are plain functions."""

    async def _run(self, call: ToolCall | CallError) -> str | CallError:
        """The call's result as text, or a `CallError`."""
        if isinstance(call, CallError):
            return call
        tool = self._tools.get(call.name)
        if tool is None:
            known = ", ".join(self._tools)
            return CallError(
                ToolCallOutcome.UNKNOWN_TOOL,
                f"error: unknown tool {call.name!r}; available: {known}",
            )
        problem = tool.check(call.arguments)
        if problem is not None:
            return CallError(ToolCallOutcome.BAD_ARGUMENTS, f"error: {call.name}: {problem}")
        timeout = self._cfg.timeout_s
        try:
            value = await asyncio.wait_for(contained(self._invoke(tool, call.arguments)), timeout)
        except TimeoutError:
            return CallError(
                ToolCallOutcome.TOOL_TIMEOUT, f"error: {call.name} gave no result in {timeout}s"
            )
        except Busy as exc:
            return CallError(
                ToolCallOutcome.TOOL_BUSY, f"error: {call.name} is busy ({exc}); not run"
            )
        except Escaped as exc:
            return CallError(ToolCallOutcome.TOOL_ERROR, f"error: {call.name} raised {exc}")
        except Exception as exc:  # the tool's own failure is the model's to read
            return CallError(
                ToolCallOutcome.TOOL_ERROR, f"error: {call.name} raised {type(exc).__name__}: {exc}"
            )
        return _text(call.name, value)

    async def _invoke(self, tool: Tool, arguments: dict[str, Any]) -> Any:
        if inspect.iscoroutinefunction(tool.fn):
            return await tool.fn(**arguments)
        value = await self._threads[tool.name].call(tool.fn, arguments)
        return await value if inspect.isawaitable(value) else value

    def _content(self, result: str | CallError) -> str:
        text = result.message if isinstance(result, CallError) else result
        return text[: self._cfg.max_result_chars]


def _text(name: str, value: Any) -> str | CallError:
    """A tool's return value as the model reads it: text as is, anything else as JSON (what
    JSON has no type for as its `str`)."""
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value, ensure_ascii=False, default=str)
    except Exception as exc:  # circular, nested past the recursion limit, keys JSON cannot hold
        return CallError(
            ToolCallOutcome.TOOL_ERROR, f"error: {name} returned what JSON cannot write: {exc}"
        )


async def _done(value: CallError) -> CallError:
    return value


def tool_environments(cfg: ToolEnvironmentConfig) -> EnvironmentFactory:
    """A maker of fresh episodes: tools loaded once, shared by every episode."""
    tools = load_tools(cfg.tools, cfg.python_path)
    threads = {
        name: SyncThreads(name, cfg.threads_per_tool)
        for name, tool in tools.items()
        if not inspect.iscoroutinefunction(tool.fn)
    }
    return lambda item, episode_id: ToolEnvironment(cfg, tools, threads)


def tool_prompt(
    cfg: ToolEnvironmentConfig, tokenizer: PreTrainedTokenizerBase
) -> Callable[[PromptItem], list[int]]:
    """The token ids an episode starts from: the system prompt (when configured, and the item
    brings none) and the item's messages, or its prompt as a user turn; the tools' schemas
    where the template puts them."""
    schemas = [t.schema for t in load_tools(cfg.tools, cfg.python_path).values()]
    system = [] if cfg.system_prompt is None else [{"role": "system", "content": cfg.system_prompt}]

    def prompt(item: PromptItem) -> list[int]:
        turns = item.messages or [{"role": "user", "content": item.prompt}]
        own_system = turns[0].get("role") == "system"
        return render_prompt(tokenizer, [*([] if own_system else system), *turns], schemas)

    return prompt
