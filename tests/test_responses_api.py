"""The Responses API translation (`asyncrl.api.responses`): requests into chat requests, chat
replies and chunks into `Response` objects and stream events that the `openai` package's own
types accept."""

from __future__ import annotations

import json

import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from asyncrl.api.responses import from_chat, stream_events, to_chat
from asyncrl.web.threaded import ApiError

ADD = {
    "type": "function",
    "name": "add",
    "description": "Add two numbers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}},
    "strict": True,
}


def test_request_becomes_the_chat_request() -> None:
    body = {
        "model": "m",
        "instructions": "Be brief.",
        "input": [
            {"role": "user", "content": "1+2?"},
            {
                "type": "message",
                "role": "assistant",
                "content": [{"type": "output_text", "text": "Let me add."}],
            },
            {"type": "function_call", "call_id": "c1", "name": "add", "arguments": '{"a":1}'},
            {"type": "function_call", "call_id": "c2", "name": "add", "arguments": '{"a":2}'},
            {"type": "function_call_output", "call_id": "c1", "output": "3"},
            {
                "type": "function_call_output",
                "call_id": "c2",
                "output": [{"type": "input_text", "text": "4"}],
            },
            {"role": "developer", "content": [{"type": "input_text", "text": "Answer now."}]},
        ],
        "tools": [ADD],
        "tool_choice": {"type": "function", "name": "add"},
        "max_output_tokens": 64,
        "temperature": 0.7,
        "include": [],
        "store": True,
    }
    chat = to_chat(body)
    assert chat["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "1+2?"},
        {
            "role": "assistant",
            "content": "Let me add.",
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "add", "arguments": '{"a":1}'},
                },
                {
                    "id": "c2",
                    "type": "function",
                    "function": {"name": "add", "arguments": '{"a":2}'},
                },
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "3"},
        {"role": "tool", "tool_call_id": "c2", "content": "4"},
        {"role": "system", "content": "Answer now."},
    ]
    assert chat["tools"] == [
        {
            "type": "function",
            "function": {
                "name": "add",
                "parameters": ADD["parameters"],
                "description": "Add two numbers.",
            },
        }
    ]
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "add"}}
    assert (chat["max_tokens"], chat["temperature"], chat["model"]) == (64, 0.7, "m")
    assert "stream" not in chat and "logprobs" not in chat


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"tools": [{"type": "web_search"}]}, "tools[0]"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input[0].content[0].type",
        ),
        ({"input": [{"type": "reasoning", "summary": []}]}, "input[0].type"),
        ({"include": ["file_search_call.results"]}, "include"),
        ({"text": {"format": {"type": "json_schema"}}}, "text"),
        ({"input": []}, "input"),
    ],
)
def test_what_it_cannot_honour_is_refused_by_name(extra: dict, param: str) -> None:
    with pytest.raises(ApiError) as err:
        to_chat({"input": "hi", **extra})
    assert err.value.param == param


def _reply(content: str | None, calls: list[tuple[str, str, str]], finish: str) -> dict:
    tool_calls = [
        {"id": i, "type": "function", "function": {"name": n, "arguments": a}} for i, n, a in calls
    ]
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "created": 1,
        "model": "m",
        "choices": [
            {
                "index": 0,
                "message": {
                    "role": "assistant",
                    "content": content,
                    "tool_calls": tool_calls or None,
                },
                "finish_reason": finish,
            }
        ],
        "usage": {"prompt_tokens": 7, "completion_tokens": 5, "total_tokens": 12},
    }


def test_reply_becomes_a_response_the_sdk_parses() -> None:
    body = {"model": "m", "input": "1+2?", "tools": [ADD]}
    resp = Response.model_validate(
        from_chat(_reply("Adding.", [("c1", "add", '{"a":1}')], "tool_calls"), body)
    )
    assert resp.status == "completed" and resp.output_text == "Adding."
    assert [o.type for o in resp.output] == ["message", "function_call"]
    call = resp.output[1]
    assert (call.call_id, call.name, call.arguments) == ("c1", "add", '{"a":1}')
    assert resp.usage is not None and (resp.usage.input_tokens, resp.usage.output_tokens) == (7, 5)
    cut = Response.model_validate(from_chat(_reply("12", [], "length"), body))
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"


def _chunks() -> list[dict]:
    def chunk(delta: dict, finish: str | None = None) -> dict:
        return {
            "id": "c",
            "object": "chat.completion.chunk",
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
        }

    call = {
        "index": 0,
        "id": "c1",
        "type": "function",
        "function": {"name": "add", "arguments": ""},
    }
    return [
        chunk({"role": "assistant", "content": ""}),
        chunk({"content": "Add"}),
        chunk({"content": "ing."}),
        chunk({"tool_calls": [call]}),
        chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"a"'}}]}),
        chunk({"tool_calls": [{"index": 0, "function": {"arguments": ":1}"}}]}),
        chunk({}, "tool_calls"),
        {
            "id": "c",
            "object": "chat.completion.chunk",
            "choices": [],
            "usage": {"prompt_tokens": 7, "completion_tokens": 5},
        },
    ]


def test_stream_events_parse_and_end_as_the_whole_reply() -> None:
    body = {"model": "m", "input": "1+2?", "tools": [ADD], "stream": True}
    adapter: TypeAdapter = TypeAdapter(ResponseStreamEvent)
    events = [
        adapter.validate_python(json.loads(json.dumps(e)))
        for e in stream_events(iter(_chunks()), body)
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    assert (
        kinds[:2] == ["response.created", "response.in_progress"]
        and kinds[-1] == "response.completed"
    )
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "Adding."
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert args == '{"a":1}'
    # Streaming ends with the same output a non-streamed reply gives.
    final = events[-1].response
    whole = Response.model_validate(
        from_chat(_reply("Adding.", [("c1", "add", '{"a":1}')], "tool_calls"), body)
    )

    def strip(r: Response) -> list[tuple[str, str | None, str | None]]:
        return [
            (o.type, getattr(o, "arguments", None), getattr(o, "call_id", None)) for o in r.output
        ]

    assert strip(final) == strip(whole) and final.output_text == whole.output_text
    assert final.usage.total_tokens == 12
