"""OpenAI-compatible `/v1/models`, `/v1/completions` and `/v1/chat/completions`: `asyncrl serve`'s,
and the agent gateway's chat (its prompts planned by the session's transcript).

Requests become the same jobs as SGLang's native `/generate` (`asyncrl.api.native`), with
OpenAI's names mapped onto SGLang's (`max_tokens` → `max_new_tokens`, `min_tokens` →
`min_new_tokens`) and SGLang's extensions accepted as its OpenAI server does (`top_k`,
`ignore_eos`, `stop_token_ids`, `skip_special_tokens`, `no_stop_trim`). Chat prompts are made
with the tokenizer's chat template (or the caller's `Render`: the agent gateway's transcript);
a tokenizer without one is refused. Chat histories may hold assistant `tool_calls` and `tool`
results, and `tools` go to the template; tool calls are parsed out of the generated text with
the Hermes/Qwen parser of `asyncrl.environments.tools` (`<tool_call>{json}</tool_call>`) and
answered as OpenAI's `tool_calls` (finish reason `tool_calls`), streamed as tool-call deltas.
`tool_choice` `none` leaves the text unparsed; no choice constrains sampling (a trained policy
is sampled from as it is). Replies, SSE chunks and `usage` take OpenAI's shapes; errors are
OpenAI's `{"error": {...}}`.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any

from asyncrl.api.native import (
    Job,
    Logprobs,
    Model,
    Output,
    build_spec,
    check_jobs,
    check_length,
    prefixes,
    refuse_unknown,
    request_id,
    typed,
)
from asyncrl.environments.tools import OPEN, ToolCall, parse_tool_calls
from asyncrl.web.threaded import ApiError, Body

COMMON_KEYS = {
    "model",
    "max_tokens",
    "min_tokens",
    "temperature",
    "top_p",
    "top_k",
    "n",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "skip_special_tokens",
    "no_stop_trim",
    "logprobs",
    "stream",
    "stream_options",
    "user",
}
COMMON_NEUTRAL: dict[str, Any] = {
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "repetition_penalty": 1.0,
    "min_p": 0.0,
    "logit_bias": None,
    "seed": None,
    "regex": None,
    "json_schema": None,
    "ebnf": None,
    "response_format": None,
    "lora_path": None,
    "rid": None,
    "return_hidden_states": False,
}
COMPLETION_KEYS = COMMON_KEYS | {"prompt"}
COMPLETION_NEUTRAL = COMMON_NEUTRAL | {"echo": False, "suffix": None, "best_of": 1}
CHAT_KEYS = COMMON_KEYS | {
    "messages",
    "max_completion_tokens",
    "top_logprobs",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "chat_template_kwargs",
}
CHAT_NEUTRAL = COMMON_NEUTRAL | {
    "continue_final_message": False,
    "separate_reasoning": True,
}
# Our key (SGLang's native name) → the request's own.
NAMES = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens"}
MAX_MESSAGES = 4096
"""The most messages a chat request may hold: refused before the chat template renders them."""
TOOL_CHOICES = ("none", "auto", "required")

Render = Callable[[list[dict[str, Any]], list[dict[str, Any]] | None, dict[str, Any]], list[int]]
"""Chat messages (as chat templates read them), tools and the template's own variables → the
prompt's token ids."""


@dataclass(frozen=True)
class OpenAIRequest:
    chat: bool
    jobs: list[Job]
    prompts: list[list[int]]
    logprobs: int | None
    """Alternatives per token when log-probs are asked for (0: only the sampled token's)."""
    stream: bool
    include_usage: bool
    tools: bool = False
    """Parse tool calls out of the generated text (a chat request with tools, `tool_choice`
    not `none`)."""


def models(model_path: str) -> dict[str, Any]:
    return {
        "object": "list",
        "data": [
            {"id": model_path, "object": "model", "created": 0, "owned_by": "asyncrl"},
        ],
    }


def _sampling(body: Body, max_tokens: Any, default_max: int | None) -> dict[str, Any]:
    raw = {
        "max_new_tokens": max_tokens if max_tokens is not None else default_max,
        "min_new_tokens": body.get("min_tokens"),
    }
    for key in ("temperature", "top_p", "top_k", "n", "stop", "stop_token_ids", "ignore_eos"):
        raw[key] = body.get(key)
    raw["skip_special_tokens"] = body.get("skip_special_tokens")
    raw["no_stop_trim"] = body.get("no_stop_trim")
    return raw


def _request(
    body: Body,
    prompts: list[list[int]],
    raw: dict[str, Any],
    logprobs: int | None,
    model: Model,
    chat: bool,
) -> OpenAIRequest:
    spec, n = build_spec(raw, model, NAMES)
    key = "messages" if chat else "prompt"
    check_jobs(len(prompts), n, key)
    ask = None if logprobs is None else Logprobs(None, logprobs, True)
    jobs = []
    for prompt in prompts:
        check_length(model, prompt, spec, key, NAMES["max_new_tokens"])
        jobs += [Job(prompt, spec, ask, request_id(None, j, n)) for j in range(n)]
    options = body.get("stream_options") or {}
    if not isinstance(options, dict) or set(options) - {"include_usage"}:
        raise ApiError("stream_options: only include_usage is supported", "stream_options")
    return OpenAIRequest(
        chat,
        jobs,
        prompts,
        logprobs,
        typed(body, "stream", bool, False, "stream"),
        bool(options.get("include_usage")),
    )


def parse_completion(body: Body, model: Model) -> OpenAIRequest:
    refuse_unknown(body, COMPLETION_KEYS, COMPLETION_NEUTRAL, "parameters")
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        prompts = [model.encode(prompt, "prompt")]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        check_jobs(len(prompt), 1, "prompt")  # before any is tokenized
        prompts = [model.encode(p, "prompt") for p in prompt]
    elif isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
        prompts = [model.check_ids(prompt, "prompt")]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, list) for p in prompt):
        prompts = [model.check_ids(p, "prompt") for p in prompt]
    else:
        raise ApiError("prompt: a string, a list of strings or of token ids", "prompt")
    logprobs = typed(body, "logprobs", int, None, "logprobs")
    if logprobs is not None and not 0 <= logprobs <= 20:
        raise ApiError("logprobs: between 0 and 20", "logprobs")
    raw = _sampling(body, body.get("max_tokens"), 16)  # OpenAI's default for completions
    return _request(body, prompts, raw, logprobs, model, chat=False)


def _content(message: dict[str, Any], empty_ok: bool) -> str:
    content = message.get("content")
    if content is None and empty_ok:
        return ""
    if isinstance(content, list):  # content parts: text only here
        if not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
            raise ApiError("messages: only text content parts are supported", "messages")
        content = "".join(str(p.get("text", "")) for p in content)
    if not isinstance(content, str):
        raise ApiError("messages: content must be a string or text parts", "messages")
    return content


def _arguments(raw: Any) -> dict[str, Any]:
    """A tool call's arguments as chat templates write them (an object), from OpenAI's JSON
    string."""
    try:
        args = json.loads(raw) if isinstance(raw, str) else raw
    except json.JSONDecodeError:
        args = None
    if not isinstance(args, dict):
        raise ApiError("messages: tool call arguments must be a JSON object", "messages")
    return args


def chat_message(message: Any) -> dict[str, Any]:
    """One OpenAI chat message as chat templates read it: text content, an assistant's
    `tool_calls` with their arguments as objects, a tool result's `tool_call_id` and `name`."""
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise ApiError("messages: each needs a role and content", "messages")
    role = message["role"]
    calls = message.get("tool_calls") if role == "assistant" else None
    out: dict[str, Any] = {"role": role, "content": _content(message, bool(calls))}
    if calls:
        if not isinstance(calls, list) or not all(
            isinstance(c, dict) and isinstance(c.get("function"), dict) for c in calls
        ):
            raise ApiError("messages: tool_calls must be a list of function calls", "messages")
        out["tool_calls"] = [
            {
                "id": c.get("id"),
                "type": "function",
                "function": {
                    "name": str(c["function"].get("name", "")),
                    "arguments": _arguments(c["function"].get("arguments", "{}")),
                },
            }
            for c in calls
        ]
    if role == "tool":
        out |= {k: message[k] for k in ("tool_call_id", "name") if isinstance(message.get(k), str)}
    return out


def _tools(body: Body) -> tuple[list[dict[str, Any]] | None, bool]:
    """The request's tools for the template, and whether to parse calls out of the reply."""
    tools = body.get("tools")
    choice = body.get("tool_choice")
    if tools is None or tools == []:
        return None, False
    if not isinstance(tools, list) or not all(
        isinstance(t, dict) and t.get("type") == "function" and isinstance(t.get("function"), dict)
        for t in tools
    ):
        raise ApiError("tools: a list of {type: function, function: {...}}", "tools")
    named = isinstance(choice, dict) and choice.get("type") == "function"
    if choice is not None and choice not in TOOL_CHOICES and not named:
        raise ApiError(
            f"tool_choice: one of {', '.join(TOOL_CHOICES)} or a function", "tool_choice"
        )
    return tools, choice != "none"


def template_render(model: Model) -> Render:
    """The chat template of the model's tokenizer (`asyncrl serve`)."""
    from asyncrl.environments.base import render_prompt

    tokenizer = model.tokenizer
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise ApiError("the model's tokenizer has no chat template", "messages")
    return lambda messages, tools, kwargs: render_prompt(tokenizer, messages, tools, **kwargs)


def parse_chat(body: Body, model: Model, render: Render | None = None) -> OpenAIRequest:
    refuse_unknown(body, CHAT_KEYS, CHAT_NEUTRAL, "parameters")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError("messages: a non-empty list", "messages")
    if len(messages) > MAX_MESSAGES:
        raise ApiError(f"messages: {len(messages)} is over {MAX_MESSAGES}", "messages")
    tools, parse = _tools(body)
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise ApiError("chat_template_kwargs: an object", "chat_template_kwargs")
    turns = [chat_message(m) for m in messages]
    try:
        ids = (render or template_render(model))(turns, tools, kwargs)
    except ApiError:
        raise
    except Exception as exc:  # the template's own refusal (a role it does not know, ...)
        raise ApiError(f"messages: the chat template refused them: {exc}", "messages") from None
    prompt = model.check_ids(ids, "messages")
    logprobs = None
    if typed(body, "logprobs", bool, False, "logprobs"):
        logprobs = typed(body, "top_logprobs", int, 0, "top_logprobs")
        if not 0 <= logprobs <= 20:
            raise ApiError("top_logprobs: between 0 and 20", "top_logprobs")
    elif body.get("top_logprobs"):
        raise ApiError("top_logprobs needs logprobs: true", "top_logprobs")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    raw = _sampling(body, max_tokens, None)
    if raw["max_new_tokens"] is None and model.max_positions is not None:
        # The default is what the context leaves; none left is the prompt's fault.
        raw["max_new_tokens"] = max(model.max_positions - len(prompt), 0)
    req = _request(body, [prompt], raw, logprobs, model, chat=True)
    return replace(req, tools=parse)


@dataclass(frozen=True)
class AssistantTurn:
    """What a chat reply says: its content and the tool calls parsed out of it."""

    content: str | None
    calls: list[ToolCall]

    def message(self, ids: list[str]) -> dict[str, Any]:
        """The OpenAI assistant message; `ids` name its tool calls."""
        out: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.calls:
            out["tool_calls"] = [
                {
                    "id": i,
                    "type": "function",
                    "function": {"name": c.name, "arguments": json.dumps(c.arguments)},
                }
                for i, c in zip(ids, self.calls, strict=True)
            ]
        return out


def assistant_turn(text: str, tools: bool) -> AssistantTurn:
    """`text` as an assistant turn: with `tools`, its well-formed `<tool_call>` blocks become
    tool calls and the text before the first is the content; a text with any block that does
    not parse stays content as it is, so that the agent sees what the model wrote."""
    parsed = parse_tool_calls(text) if tools else []
    calls = [c for c in parsed if isinstance(c, ToolCall)]
    if not parsed or len(calls) < len(parsed):
        return AssistantTurn(text, [])
    return AssistantTurn(text[: text.index(OPEN)].strip() or None, calls)


def _call_ids(turn: AssistantTurn) -> list[str]:
    return ["call_" + uuid.uuid4().hex[:24] for _ in turn.calls]


def _finish_reason(out: Output) -> str | None:
    kind = out.finish.get("type")
    return None if kind is None else "stop" if kind == "stop" else str(kind)


def _token_logprobs(req: OpenAIRequest, job: Job, out: Output, model: Model, start: int = 0) -> Any:
    """OpenAI's log-prob object for `out`'s tokens from `start` on."""
    if req.logprobs is None:
        return None
    tokens = out.tokens[start:]
    texts = model.token_texts(tokens)
    tops: list[list[tuple[str, float]]] = [[] for _ in tokens]
    if req.logprobs > 0 and out.logp is not None:
        n = len(job.prompt)
        for t in range(len(tokens)):
            top, ids = out.logp[n - 1 + start + t].topk(req.logprobs)
            tops[t] = list(zip(model.token_texts(ids.tolist()), top.tolist(), strict=True))
    values = out.logprobs[start:]
    if req.chat:
        return {
            "content": [
                {
                    "token": s,
                    "logprob": v,
                    "bytes": list(s.encode()),
                    "top_logprobs": [
                        {"token": ts, "logprob": tv, "bytes": list(ts.encode())} for ts, tv in top
                    ],
                }
                for s, v, top in zip(texts, values, tops, strict=True)
            ]
        }
    offsets, at = [], 0
    for s in texts:
        offsets.append(at)
        at += len(s)
    return {
        "tokens": texts,
        "token_logprobs": values,
        "top_logprobs": [dict(top) for top in tops],
        "text_offset": offsets,
    }


def _usage(req: OpenAIRequest, outs: list[Output]) -> dict[str, int]:
    prompt = sum(len(p) for p in req.prompts)
    completion = sum(len(o.tokens) for o in outs)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


def message_of(req: OpenAIRequest, out: Output) -> dict[str, Any]:
    """The assistant message a chat reply gives for `out`."""
    turn = assistant_turn(out.text, req.tools)
    return turn.message(_call_ids(turn))


def _chat_finish(out: Output | None, message: dict[str, Any]) -> str | None:
    finish = None if out is None else _finish_reason(out)
    return "tool_calls" if finish is not None and message.get("tool_calls") else finish


def _choice(
    req: OpenAIRequest, index: int, out: Output, logprobs: Any, message: dict[str, Any] | None
) -> Any:
    matched = out.finish.get("matched")
    if message is not None:
        return {
            "index": index,
            "message": message,
            "logprobs": logprobs,
            "finish_reason": _chat_finish(out, message),
            "matched_stop": matched,
        }
    return {
        "index": index,
        "text": out.text,
        "logprobs": logprobs,
        "finish_reason": _finish_reason(out),
        "matched_stop": matched,
    }


def reply(
    req: OpenAIRequest,
    outs: list[Output],
    model: Model,
    name: str,
    messages: list[dict[str, Any]] | None = None,
) -> Any:
    """The whole reply, or for `stream` the iterator of its SSE chunks. A chat reply's
    `messages` (one per output) are made here unless the caller made them (`message_of`)."""
    head = {
        "id": ("chatcmpl-" if req.chat else "cmpl-") + uuid.uuid4().hex,
        "object": "chat.completion" if req.chat else "text_completion",
        "created": int(time.time()),
        "model": name,
    }
    said: list[dict[str, Any] | None] = [None] * len(outs)
    if req.chat:
        said = list(messages) if messages is not None else [message_of(req, o) for o in outs]
    if req.stream:
        return _chunks(req, outs, model, head, said)
    choices = [
        _choice(req, i, out, _token_logprobs(req, job, out, model), said[i])
        for i, (job, out) in enumerate(zip(req.jobs, outs, strict=True))
    ]
    return head | {"choices": choices, "usage": _usage(req, outs)}


def _chunks(
    req: OpenAIRequest,
    outs: list[Output],
    model: Model,
    head: dict[str, Any],
    said: list[dict[str, Any] | None],
) -> Iterator[dict[str, Any]]:
    """A chat stream shows the content as its tokens produce it, then each tool call whole
    (index, id, name and arguments in one delta), then the finish reason."""
    if req.chat:
        head = head | {"object": "chat.completion.chunk"}
    for index, (job, out) in enumerate(zip(req.jobs, outs, strict=True)):
        message = said[index]
        content = "" if message is None else message["content"] or ""
        if message is not None:
            role = {"index": index, "delta": {"role": "assistant", "content": ""}}
            yield head | {"choices": [role | {"logprobs": None, "finish_reason": None}]}
        shown, done = 0, 0
        for stage, last in prefixes(out, model, job.spec):
            text = stage.text if message is None else stage.text[: len(content)]
            delta = text[shown:]
            shown = len(text)
            logprobs = _token_logprobs(req, job, out, model, done)
            if logprobs is not None:  # this chunk's tokens only
                end = len(stage.tokens) - done
                logprobs = {k: v[:end] for k, v in logprobs.items()}
            done = len(stage.tokens)
            if message is None:
                choice = {"index": index, "text": delta}
                finish = _finish_reason(out) if last else None
            else:
                choice = {"index": index, "delta": {"content": delta}}
                finish = None
            yield head | {"choices": [choice | {"logprobs": logprobs, "finish_reason": finish}]}
        if message is None:
            continue
        for k, call in enumerate(message.get("tool_calls") or []):
            called = {"tool_calls": [{"index": k, **call}]}
            yield head | {
                "choices": [
                    {"index": index, "delta": called, "logprobs": None, "finish_reason": None}
                ]
            }
        closing = {"index": index, "delta": {}, "logprobs": None}
        yield head | {"choices": [closing | {"finish_reason": _chat_finish(out, message)}]}
    if req.include_usage:
        yield head | {"choices": [], "usage": _usage(req, outs)}
