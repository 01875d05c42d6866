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

A turn without a call is the final answer: the episode ends, scored by the configured reward or,
when none is, by the task's (`StepResult.reward` None).
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

from asyncrl.environments.base import StepResult
from asyncrl.environments.tool_config import ToolEnvironmentConfig
from asyncrl.tasks.plugins import load_object
from asyncrl.tasks.rewards import RewardFn, build_reward

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from asyncrl.tasks.base import PromptItem

MALFORMED_JSON, BAD_CALL, UNCLOSED_CALL = "malformed_json", "bad_call", "unclosed_call"
UNKNOWN_TOOL, BAD_ARGUMENTS, TOO_MANY_CALLS = "unknown_tool", "bad_arguments", "too_many_calls"
TOOL_ERROR, TOOL_TIMEOUT = "tool_error", "tool_timeout"

OPEN, CLOSE = "<tool_call>", "</tool_call>"
# Stands for an assistant turn's content where `render_observation` cuts the template open.
_MARK = "\x00asyncrl-assistant\x00"
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
    """One episode with tools (an `Environment`).

    `reset` gives the prompt as chat messages (a system message first when configured); render
    them with `render_prompt(tokenizer, messages, env.tools)` so the template shows the tools.
    Each `step` runs the turn's calls concurrently, each bounded by `timeout_s`, and answers
    with one `tool` message per call, in order. `errors` counts failed calls by reason over the
    episode; each step's `info` holds that turn's `calls` and `errors`.
    """

    def __init__(
        self, cfg: ToolEnvironmentConfig, tools: dict[str, Tool], reward: RewardFn | None
    ) -> None:
        self._cfg = cfg
        self._tools = tools
        self._reward = reward
        self._answer: Any = None
        self.turns = 0
        self.calls = 0
        """Calls that ran and returned."""
        self.errors: Counter[str] = Counter()

    @property
    def tools(self) -> list[dict[str, Any]]:
        """The tools' schemas, for the chat template's `tools=`."""
        return [t.schema for t in self._tools.values()]

    async def reset(self, item: PromptItem) -> Messages:
        self._answer = item.answer
        system = self._cfg.system_prompt
        first = [] if system is None else [{"role": "system", "content": system}]
        return [*first, {"role": "user", "content": item.prompt}]

    async def step(self, response: str) -> StepResult:
        self.turns += 1
        calls = parse_tool_calls(response)
        if not calls or self.turns >= self._cfg.max_turns:
            info = {"ended": "answer" if not calls else "max_turns"}
            return StepResult(None, True, await self._score(response), info)
        limit = self._cfg.max_calls_per_turn
        over = CallError(TOO_MANY_CALLS, f"error: at most {limit} tool calls per turn; not run")
        results = await asyncio.gather(
            *(self._run(c) for c in calls[:limit]), *(_done(over) for _ in calls[limit:])
        )
        errors = Counter(r.reason for r in results if isinstance(r, CallError))
        self.errors.update(errors)
        ran = len(results) - errors.total()
        self.calls += ran
        messages = [{"role": "tool", "content": self._content(r)} for r in results]
        return StepResult(messages, False, None, {"calls": ran, "errors": dict(errors)})

    async def close(self) -> None:
        """Nothing held: tools are plain functions."""

    async def _score(self, response: str) -> float | None:
        if self._reward is None:
            return None
        return await asyncio.to_thread(self._reward, response, self._answer)

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


def tool_environments(cfg: ToolEnvironmentConfig) -> Callable[[], ToolEnvironment]:
    """A maker of fresh episodes: tools and reward loaded once, shared by every episode."""
    tools = load_tools(cfg.tools, cfg.python_path)
    reward = None if cfg.reward is None else build_reward(cfg.reward)
    return lambda: ToolEnvironment(cfg, tools, reward)


def render_prompt(
    tokenizer: PreTrainedTokenizerBase, messages: Messages, tools: list[dict[str, Any]] | None
) -> list[int]:
    """Token ids of the episode's first messages, the tools in the template's system turn and
    the generation prompt added."""
    text = tokenizer.apply_chat_template(
        messages, tools=_schemas(tools), tokenize=False, add_generation_prompt=True
    )
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def render_observation(
    tokenizer: PreTrainedTokenizerBase,
    messages: Messages,
    tools: list[dict[str, Any]] | None,
    ended_with: str | None,
) -> list[int]:
    """Token ids that follow an assistant turn so that the context reads as the chat template
    renders the whole conversation: the end of the assistant turn, `messages`, the next
    generation prompt. `ended_with` is the text of the special token that ended the turn
    (`<|im_end|>`), which the context already holds; None when the turn was cut by the token
    limit, and the template's end of turn is supplied.

    The template renders a placeholder conversation (a user turn, an assistant turn, then
    `messages`), cut after the assistant's content: a tool message alone would render
    differently (Qwen2.5 puts a default system turn first), and what precedes it may depend on
    what follows (Qwen3 adds an empty `<think>` block only to a final assistant turn).
    """
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "?"}, {"role": "assistant", "content": _MARK}, *messages],
        tools=_schemas(tools),
        tokenize=False,
        add_generation_prompt=True,
    )
    _, mark, after = str(text).partition(_MARK)
    if not mark:
        raise ValueError("the chat template drops the content of an assistant turn")
    if ended_with and after.startswith(ended_with):
        after = after[len(ended_with) :]
    return list(tokenizer(after, add_special_tokens=False)["input_ids"])


def _schemas(
    tools: list[dict[str, Any]] | None,
) -> list[dict[Any, Any] | Callable[..., Any]] | None:
    """`tools=` as transformers types it (it also takes functions, which it makes schemas of)."""
    return None if tools is None else [*tools]
