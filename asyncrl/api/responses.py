"""OpenAI's Responses API (`POST /v1/responses`) as a translation over Chat Completions.

The OpenAI Agents SDK's default model speaks the Responses API. A Responses request is a chat
request in other words: `instructions` is a system turn, `input` items are turns (`message`
items with text parts, `function_call` items are an assistant turn's tool calls,
`function_call_output` items `tool` turns), `tools` are function tools with their schema one
level up. So `to_chat` rewrites the request into a Chat Completions body, the one chat layer
(`asyncrl.api.openai`) renders, generates and parses tool calls, and `from_chat` /
`stream_events` rewrite its reply or its SSE chunks into a `Response` object or Responses
stream events. Whatever the chat layer records (the gateway's token-exact capture) is recorded
the same way for both APIs.

Stateless: nothing is stored, so `previous_response_id` and `conversation` are refused (the
client sends the whole input, as the Agents SDK does by default); `store` is accepted and means
nothing more. A key or item type it cannot honour (hosted tools such as `web_search`, image or
file inputs, reasoning items, structured output) is refused with a 400 naming it, never ignored.

Worked example: `{"instructions": "Be brief.", "input": [{"role": "user", "content": "1+2?"},
{"type": "function_call", "call_id": "c1", "name": "add", "arguments": "{\\"a\\":1,\\"b\\":2}"},
{"type": "function_call_output", "call_id": "c1", "output": "3"}]}` becomes the messages
`system "Be brief."`, `user "1+2?"`, `assistant tool_calls=[c1 add(...)]`, `tool(c1) "3"`.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

from asyncrl.api.native import refuse_unknown, typed
from asyncrl.web.threaded import ApiError, Body, Stream

KEYS = {
    "model",
    "input",
    "instructions",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "temperature",
    "top_p",
    "max_output_tokens",
    "stream",
    "include",
    "store",
    "metadata",
    "user",
    "top_logprobs",
}
NEUTRAL: dict[str, Any] = {
    "previous_response_id": None,
    "conversation": None,
    "reasoning": None,
    "truncation": "disabled",
    "text": {"format": {"type": "text"}},
    "background": False,
    "service_tier": "auto",
    "prompt_cache_key": None,
    "safety_identifier": None,
}
LOGPROBS_INCLUDE = "message.output_text.logprobs"


def respond(body: Body, chat: Callable[[Body], Any]) -> Any:
    """`POST /v1/responses` answered through a server's Chat Completions route `chat`: the
    `Response`, or a `Stream` of its events."""
    reply = chat(to_chat(body))
    if isinstance(reply, Stream):
        return Stream(stream_events(iter(reply.chunks), body))
    return from_chat(reply, body)


def to_chat(body: Body) -> Body:
    """The Chat Completions request that asks what `body` asks; 400 for what it cannot."""
    refuse_unknown(body, KEYS, NEUTRAL, "parameters")
    messages: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise ApiError("instructions: a string", "instructions")
        messages.append({"role": "system", "content": instructions})
    raw = body.get("input")
    if isinstance(raw, str):
        messages.append({"role": "user", "content": raw})
    elif isinstance(raw, list) and raw:
        for i, item in enumerate(raw):
            _add_item(messages, item, f"input[{i}]")
    else:
        raise ApiError("input: a string or a non-empty list of items", "input")
    chat: Body = {"messages": messages}
    for key in ("model", "temperature", "top_p", "parallel_tool_calls", "user"):
        if body.get(key) is not None:
            chat[key] = body[key]
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    if body.get("tools"):
        chat["tools"] = [_tool(t, f"tools[{i}]") for i, t in enumerate(_list(body, "tools"))]
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = _tool_choice(body["tool_choice"])
    include = _list(body, "include")
    if set(include) - {LOGPROBS_INCLUDE}:
        raise ApiError(f"include: only {LOGPROBS_INCLUDE} is supported", "include")
    if include or body.get("top_logprobs"):
        chat["logprobs"] = True
        chat["top_logprobs"] = typed(body, "top_logprobs", int, 0, "top_logprobs")
    if typed(body, "stream", bool, False, "stream"):
        chat["stream"] = True
        chat["stream_options"] = {"include_usage": True}
    return chat


def _list(body: Body, key: str) -> list[Any]:
    value = body.get(key) or []
    if not isinstance(value, list):
        raise ApiError(f"{key}: a list", key)
    return value


def _text(content: Any, where: str) -> str:
    """A message's content: a string, or text parts (`input_text` / `output_text`)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ApiError(f"{where}.content: a string or a list of text parts", where)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text") or not isinstance(
            part.get("text"), str
        ):
            raise ApiError(
                f"{where}.content[{j}]: only text parts are supported (got {kind!r})",
                f"{where}.content[{j}].type",
            )
        texts.append(part["text"])
    return "".join(texts)


def _add_item(messages: list[dict[str, Any]], item: Any, where: str) -> None:
    if not isinstance(item, dict):
        raise ApiError(f"{where}: an object", where)
    kind = item.get("type", "message")
    if kind == "message":
        role = item.get("role")
        if role not in ("user", "system", "developer", "assistant"):
            raise ApiError(f"{where}.role: user, system, developer or assistant", f"{where}.role")
        messages.append(
            {
                "role": "system" if role == "developer" else role,
                "content": _text(item.get("content"), where),
            }
        )
    elif kind == "function_call":
        call = {
            "id": _str(item, "call_id", where),
            "type": "function",
            "function": {
                "name": _str(item, "name", where),
                "arguments": _str(item, "arguments", where),
            },
        }
        last = messages[-1] if messages else None
        # The calls of one turn (and the text before them) are one assistant message.
        if last is not None and last["role"] == "assistant":
            last.setdefault("tool_calls", []).append(call)
        else:
            messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
    elif kind == "function_call_output":
        output = item.get("output")
        content = output if isinstance(output, str) else _text(output, where)
        messages.append(
            {"role": "tool", "tool_call_id": _str(item, "call_id", where), "content": content}
        )
    else:
        raise ApiError(f"{where}.type: {kind!r} is not supported", f"{where}.type")


def _str(item: dict[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise ApiError(f"{where}.{key}: a string", f"{where}.{key}")
    return value


def _tool(tool: Any, where: str) -> dict[str, Any]:
    if not isinstance(tool, dict) or tool.get("type") != "function":
        kind = tool.get("type") if isinstance(tool, dict) else None
        raise ApiError(f"{where}: only function tools are supported (got {kind!r})", where)
    function = {"name": _str(tool, "name", where), "parameters": tool.get("parameters") or {}}
    if tool.get("description") is not None:
        function["description"] = tool["description"]
    return {"type": "function", "function": function}


def _tool_choice(choice: Any) -> Any:
    if choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": _str(choice, "name", "tool_choice")}}
    raise ApiError("tool_choice: auto, none, required or a function", "tool_choice")


def _echo(body: Body) -> dict[str, Any]:
    """The request's settings, as a `Response` repeats them."""
    return {
        "object": "response",
        "model": body.get("model") or "",
        "instructions": body.get("instructions"),
        "tools": body.get("tools") or [],
        "tool_choice": body.get("tool_choice") or "auto",
        "parallel_tool_calls": body.get("parallel_tool_calls", True) is not False,
        "temperature": body.get("temperature"),
        "top_p": body.get("top_p"),
        "max_output_tokens": body.get("max_output_tokens"),
        "metadata": body.get("metadata") or {},
        "store": bool(body.get("store", False)),
        "text": {"format": {"type": "text"}},
        "truncation": "disabled",
        "error": None,
    }


def _usage(usage: dict[str, Any] | None) -> dict[str, Any] | None:
    if not usage:
        return None
    prompt, completion = usage.get("prompt_tokens", 0), usage.get("completion_tokens", 0)
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + completion,
    }


def _status(finish: str | None) -> tuple[str, dict[str, str] | None]:
    if finish == "length":
        return "incomplete", {"reason": "max_output_tokens"}
    return "completed", None


def _message_item(item_id: str, text: str, logprobs: list[Any] | None, status: str) -> dict:
    part: dict[str, Any] = {"type": "output_text", "text": text, "annotations": []}
    if logprobs is not None:
        part["logprobs"] = logprobs
    return {
        "type": "message",
        "id": item_id,
        "status": status,
        "role": "assistant",
        "content": [part],
    }


def _call_item(call: dict[str, Any], status: str) -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": f"fc_{call['id']}",
        "call_id": call["id"],
        "name": call["function"]["name"],
        "arguments": call["function"]["arguments"],
        "status": status,
    }


def from_chat(reply: dict[str, Any], body: Body) -> dict[str, Any]:
    """The `Response` object of a Chat Completions reply to `to_chat(body)`."""
    choice = reply["choices"][0]
    message = choice["message"]
    logprobs = (choice.get("logprobs") or {}).get("content") if body.get("include") else None
    output = []
    if message.get("content"):
        output.append(
            _message_item(f"msg_{reply['id']}", message["content"], logprobs, "completed")
        )
    output += [_call_item(call, "completed") for call in message.get("tool_calls") or []]
    status, incomplete = _status(choice.get("finish_reason"))
    return {
        **_echo(body),
        "id": f"resp_{reply['id']}",
        "created_at": reply.get("created", time.time()),
        "status": status,
        "incomplete_details": incomplete,
        "output": output,
        "usage": _usage(reply.get("usage")),
    }


class _Events:
    """Numbers the events of one stream (`sequence_number`)."""

    def __init__(self) -> None:
        self.n = 0

    def __call__(self, kind: str, **fields: Any) -> dict[str, Any]:
        self.n += 1
        return {"type": kind, "sequence_number": self.n - 1, **fields}


def stream_events(chunks: Iterator[dict[str, Any]], body: Body) -> Iterator[dict[str, Any]]:
    """Responses stream events from the SSE chunks of a streamed chat reply: text deltas as
    `response.output_text.delta`, each tool call as a `function_call` item whose arguments
    arrive as `response.function_call_arguments.delta`, then `response.completed` (or
    `response.incomplete`) with the whole `Response`."""
    event = _Events()
    response_id = f"resp_{uuid.uuid4().hex}"
    base = {**_echo(body), "id": response_id, "created_at": time.time()}
    yield event("response.created", response={**base, "status": "in_progress", "output": []})
    yield event("response.in_progress", response={**base, "status": "in_progress", "output": []})
    output: list[dict[str, Any]] = []
    text_index: int | None = None
    calls: dict[int, int] = {}  # the chat's tool-call index → output index
    finish, usage = None, None
    for chunk in chunks:
        usage = chunk.get("usage") or usage
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            finish = choice.get("finish_reason") or finish
            if delta.get("content"):
                if text_index is None:
                    text_index = len(output)
                    output.append(_message_item(f"msg_{response_id}", "", None, "in_progress"))
                    yield event(
                        "response.output_item.added",
                        output_index=text_index,
                        item=output[text_index],
                    )
                    yield event(
                        "response.content_part.added",
                        item_id=output[text_index]["id"],
                        output_index=text_index,
                        content_index=0,
                        part={"type": "output_text", "text": "", "annotations": []},
                    )
                output[text_index]["content"][0]["text"] += delta["content"]
                yield event(
                    "response.output_text.delta",
                    item_id=output[text_index]["id"],
                    output_index=text_index,
                    content_index=0,
                    delta=delta["content"],
                    logprobs=[],
                )
            for call in delta.get("tool_calls") or []:
                yield from _call_delta(event, output, calls, call)
    yield from _close_items(event, output, text_index)
    status, incomplete = _status(finish)
    done = {**base, "status": status, "incomplete_details": incomplete, "output": output}
    done["usage"] = _usage(usage)
    kind = "response.completed" if status == "completed" else "response.incomplete"
    yield event(kind, response=done)


def _call_delta(
    event: _Events, output: list[dict[str, Any]], calls: dict[int, int], call: dict[str, Any]
) -> Iterator[dict[str, Any]]:
    index = call.get("index", 0)
    function = call.get("function") or {}
    if index not in calls:
        calls[index] = len(output)
        start: dict[str, Any] = {
            "id": call.get("id") or f"call_{uuid.uuid4().hex[:24]}",
            "function": {"name": function.get("name") or "", "arguments": ""},
        }
        output.append(_call_item(start, "in_progress"))
        yield event(
            "response.output_item.added", output_index=calls[index], item=output[calls[index]]
        )
    item = output[calls[index]]
    if function.get("arguments"):
        item["arguments"] += function["arguments"]
        yield event(
            "response.function_call_arguments.delta",
            item_id=item["id"],
            output_index=calls[index],
            delta=function["arguments"],
        )


def _close_items(
    event: _Events, output: list[dict[str, Any]], text_index: int | None
) -> Iterator[dict[str, Any]]:
    for index, item in enumerate(output):
        item["status"] = "completed"
        if index == text_index:
            part = item["content"][0]
            ids = {"item_id": item["id"], "output_index": index, "content_index": 0}
            yield event("response.output_text.done", **ids, text=part["text"], logprobs=[])
            yield event("response.content_part.done", **ids, part=part)
        else:
            yield event(
                "response.function_call_arguments.done",
                item_id=item["id"],
                output_index=index,
                arguments=item["arguments"],
            )
        yield event("response.output_item.done", output_index=index, item=item)
