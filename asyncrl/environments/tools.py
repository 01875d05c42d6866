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
available: add`), and counted by reason (`CallError.reason`): `malformed_json`, `bad_call` (not
an object with a string `name`), `unclosed_call` (no `</tool_call>`, e.g. cut by the token
limit), `unknown_tool`, `bad_arguments`, `too_many_calls`, `tool_error` (it raised) and
`tool_timeout`. A bad call never fails the episode: telling the model is what trains it.

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
import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from asyncrl.environments.base import EnvironmentFactory, StepResult, render_prompt

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from asyncrl.environments.config import ToolEnvironmentConfig
    from asyncrl.tasks.base import PromptItem

MALFORMED_JSON, BAD_CALL, UNCLOSED_CALL = "malformed_json", "bad_call", "unclosed_call"
UNKNOWN_TOOL, BAD_ARGUMENTS, TOO_MANY_CALLS = "unknown_tool", "bad_arguments", "too_many_calls"
TOOL_ERROR, TOOL_TIMEOUT = "tool_error", "tool_timeout"
OK = "ok"
TOOL_CALL_OUTCOMES = (
    OK,
    *(MALFORMED_JSON, BAD_CALL, UNCLOSED_CALL, UNKNOWN_TOOL, BAD_ARGUMENTS, TOO_MANY_CALLS),
    *(TOOL_ERROR, TOOL_TIMEOUT),
)
"""What became of one tool call (label of `asyncrl_tool_calls_total`): it ran and returned, or
why it did not."""

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

    reason: str
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
        calls.append(CallError(UNCLOSED_CALL, f"error: {OPEN} without {CLOSE}"))
    return calls


def _parse_one(body: str) -> ToolCall | CallError:
    try:
        call = json.loads(body)
    except json.JSONDecodeError as exc:
        return CallError(MALFORMED_JSON, f"error: the tool call is not valid JSON ({exc.msg})")
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return CallError(BAD_CALL, 'error: expected {"name": <tool name>, "arguments": {...}}')
    arguments = call.get("arguments", {})
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        with contextlib.suppress(json.JSONDecodeError):
            arguments = json.loads(arguments)
    if not isinstance(arguments, dict):
        return CallError(BAD_ARGUMENTS, "error: arguments must be a JSON object")
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
    from asyncrl.tasks.plugins import load_object

    tools: dict[str, Tool] = {}
    for i, path in enumerate(paths):
        fn = load_object(path, python_path)
        try:
            tool = Tool(fn, tool_schema(fn))
        except Exception as exc:  # transformers' parsing errors share no base class
            raise ValueError(f"environment.tools[{i}] {path!r}: no JSON schema: {exc}") from None
        tools[tool.name] = tool
    return tools


class ToolEnvironment:
    """One episode with tools (an `Environment`); its prompt comes from `tool_prompt`.

    Each `step` runs the turn's calls concurrently, each bounded by `timeout_s`, and answers
    with one `tool` message per call, in order; its `info["tool_calls"]` counts that turn's
    calls by outcome. `calls` (calls that ran and returned) and `errors` (by reason) add up the
    episode.
    """

    def __init__(self, cfg: ToolEnvironmentConfig, tools: dict[str, Tool]) -> None:
        self._cfg = cfg
        self._tools = tools
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
        over = CallError(TOO_MANY_CALLS, f"error: at most {limit} tool calls per turn; not run")
        results = await asyncio.gather(
            *(self._run(c) for c in calls[:limit]), *(_done(over) for _ in calls[limit:])
        )
        outcomes = Counter(r.reason if isinstance(r, CallError) else OK for r in results)
        self.calls += outcomes[OK]
        self.errors.update({k: n for k, n in outcomes.items() if k != OK})
        messages = [{"role": "tool", "content": self._content(r)} for r in results]
        return StepResult(messages, False, None, {"tool_calls": dict(outcomes)})

    async def close(self) -> None:
        """Nothing held: tools are plain functions."""

    async def _run(self, call: ToolCall | CallError) -> Any:
        """The call's return value, or a `CallError`."""
        if isinstance(call, CallError):
            return call
        tool = self._tools.get(call.name)
        if tool is None:
            known = ", ".join(self._tools)
            return CallError(UNKNOWN_TOOL, f"error: unknown tool {call.name!r}; available: {known}")
        problem = tool.check(call.arguments)
        if problem is not None:
            return CallError(BAD_ARGUMENTS, f"error: {call.name}: {problem}")
        timeout = self._cfg.timeout_s
        try:
            return await asyncio.wait_for(_invoke(tool.fn, call.arguments), timeout)
        except TimeoutError:
            return CallError(TOOL_TIMEOUT, f"error: {call.name} gave no result in {timeout}s")
        except Exception as exc:  # the tool's own failure is the model's to read
            return CallError(TOOL_ERROR, f"error: {call.name} raised {type(exc).__name__}: {exc}")

    def _content(self, result: Any) -> str:
        if isinstance(result, CallError):
            text = result.message
        elif isinstance(result, str):
            text = result
        else:
            text = json.dumps(result, ensure_ascii=False, default=str)
        return text[: self._cfg.max_result_chars]


async def _invoke(fn: Callable[..., Any], arguments: dict[str, Any]) -> Any:
    if inspect.iscoroutinefunction(fn):
        return await fn(**arguments)
    value = await asyncio.to_thread(fn, **arguments)
    return await value if inspect.isawaitable(value) else value


async def _done(value: CallError) -> CallError:
    return value


def tool_environments(cfg: ToolEnvironmentConfig) -> EnvironmentFactory:
    """A maker of fresh episodes: tools loaded once, shared by every episode."""
    tools = load_tools(cfg.tools, cfg.python_path)
    return lambda item, episode_id: ToolEnvironment(cfg, tools)


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
