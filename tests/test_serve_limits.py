"""`asyncrl serve` (a real process, the chat-template tiny model) against malformed and oversized
requests over real HTTP: every one is a 4xx naming what is wrong, never a 500 or a dropped or
hung connection; `n`, the generations of a request, the messages of a chat, the prompt against the
model's positions and the body size are bounded."""

from __future__ import annotations

import http.client
import json
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

from asyncrl.api.native import MAX_JOBS, MAX_N
from asyncrl.api.openai import MAX_MESSAGES
from asyncrl.web.threaded import MAX_BODY_BYTES

CHAT = "/v1/chat/completions"
ONE = {"max_new_tokens": 1}
FOUR = {"max_new_tokens": 1, "n": 4}
OVER_BY_FOUR = [[1]] * (MAX_JOBS // 4 + 1)
"""Prompts that make more than `MAX_JOBS` generations at n = 4."""
DEEP = b"[" * 100_000 + b"]" * 100_000
"""Nested past what `json.loads` can recurse."""


@pytest.fixture(scope="module")
def random_model(chat_model: Path) -> Path:
    """The module's `served` runs the model whose tokenizer spells text and has a chat template."""
    return chat_model


def send(url: str, path: str, raw: bytes, length: str | None = None) -> tuple[int, dict[str, Any]]:
    """POST `raw` with Content-Length `length` (default: its true length); the reply's status and
    error object (OpenAI's `error`, or SGLang's body)."""
    where = urlsplit(url)
    conn = http.client.HTTPConnection(where.hostname, where.port, timeout=60)
    try:
        conn.putrequest("POST", path)
        conn.putheader("Content-Type", "application/json")
        conn.putheader("Content-Length", str(len(raw)) if length is None else length)
        conn.endheaders(raw)
        reply = conn.getresponse()
        raw = reply.read()
    finally:
        conn.close()
    if reply.headers.get("Content-Type") != "application/json":
        return reply.status, {}  # a stream or text
    body = json.loads(raw)
    return reply.status, body.get("error", body) if isinstance(body, dict) else {}


def chat(content: str = "hi", **extra: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": content}], **extra}


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        # Unbounded sizes (sized to be cheap where they are not refused: n = 10**9 was taken),
        # each refused before any work is done for it.
        ("/generate", {"input_ids": [1, 2], "sampling_params": {"n": MAX_N + 1, **ONE}}, "n"),
        ("/v1/completions", {"prompt": "ab", "max_tokens": 1, "n": MAX_N + 1}, "n"),
        (CHAT, chat(max_tokens=1, n=MAX_N + 1), "n"),
        ("/generate", {"input_ids": OVER_BY_FOUR, "sampling_params": FOUR}, "input_ids"),
        ("/generate", {"text": ["a"] * (MAX_JOBS + 1), "sampling_params": ONE}, "text"),
        ("/v1/completions", {"prompt": ["a"] * (MAX_JOBS + 1), "max_tokens": 1}, "prompt"),
        (CHAT, {"messages": [{"role": "user", "content": "a"}] * (MAX_MESSAGES + 1)}, "messages"),
        # The prompt against the model's 128 positions, named by the request's own keys.
        ("/v1/completions", {"prompt": "ab", "max_tokens": 10**6}, "max_tokens"),
        (CHAT, chat("a" * 200), "messages"),
        ("/generate", {"input_ids": [1] * 200, "sampling_params": ONE}, "input_ids"),
        # Malformed fields that answered 500.
        ("/unload_lora_adapter", {"lora_name": ["x"]}, "lora_name"),
    ],
)  # fmt: skip
def test_oversized_and_malformed_fields_are_a_400_naming_the_field(
    served: str, path: str, body: dict[str, Any], param: str
) -> None:
    status, error = send(served, path, json.dumps(body).encode())
    assert (status, error["code"], error["param"]) == (400, 400, param), error
    assert param in error["message"] or "prompt" in error["message"], error


@pytest.mark.parametrize(
    ("path", "raw"),
    [
        ("/generate", DEEP),
        ("/v1/completions", b'{"prompt": ' + DEEP + b"}"),
        ("/update_weight_version", b'{"new_version": Infinity, "abort_all_requests": false}'),
        ("/update_weights_from_disk", b'{"weight_version": -Infinity, "model_path": "/nowhere"}'),
        (
            "/init_weights_update_group",
            b'{"rank_offset": Infinity, "world_size": 2, "backend": "gloo",'
            b' "master_address": "127.0.0.1", "master_port": 1}',
        ),
    ],
)
def test_bodies_that_answered_500_are_a_400(served: str, path: str, raw: bytes) -> None:
    status, error = send(served, path, raw)
    assert (status, error["code"]) == (400, 400), error


def test_an_unloadable_weights_file_is_a_400_naming_model_path(served: str, tmp_path: Path) -> None:
    (tmp_path / "model.safetensors").write_bytes(b"not a safetensors file")
    body = {"weight_version": 1, "model_path": str(tmp_path)}
    status, error = send(served, "/update_weights_from_disk", json.dumps(body).encode())
    assert (status, error["param"]) == (400, "model_path"), error
    assert "model.safetensors" in error["message"]


@pytest.mark.parametrize("length", ["abc", "-1", "1e3"])
def test_a_bad_content_length_is_a_400(served: str, length: str) -> None:
    """Before: "abc" dropped the connection with a traceback, "-1" read until the client hung up."""
    status, error = send(served, "/generate", b"{}", length)
    assert (status, error["param"]) == (400, "Content-Length"), error


def test_a_body_over_the_limit_is_refused_unread(served: str) -> None:
    # Only the head is sent: the server answers without waiting for the gigabyte it announced.
    status, error = send(served, CHAT, b"", str(1 << 30))
    assert (status, error["code"], error["param"]) == (413, 413, "Content-Length"), error
    assert error["type"] == "invalid_request_error" and str(MAX_BODY_BYTES) in error["message"]
    status, _ = send(served, CHAT, json.dumps(chat(max_tokens=1)).encode())
    assert status == 200  # and it goes on serving


VALUES = [None, True, -1, 0, 10**30, 1.5, "NaN", "Infinity", "x", [], [1.5], {}, {"a": 1}, [[]]]
"""A field set to each: wrong types, out-of-range and non-finite numbers, empty containers."""


def _literal(value: Any) -> str:
    """NaN and Infinity as JSON's own tokens (`json.loads` takes them), the rest as JSON."""
    return value if value in ("NaN", "Infinity") else json.dumps(value)


def _mutations(path: str, base: dict[str, Any], keys: list[str]) -> list[tuple[str, bytes]]:
    """`base` with each of `keys` set to each of `VALUES`."""
    out = []
    for key in keys:
        head = json.dumps({k: v for k, v in base.items() if k != key})[:-1]
        out += [(path, f'{head}, "{key}": {_literal(v)}}}'.encode()) for v in VALUES]
    return out


FUZZ = [
    *_mutations(
        "/generate",
        {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1}},
        ["text", "input_ids", "sampling_params", "return_logprob", "logprob_start_len",
         "top_logprobs_num", "stream", "rid", "lora_path", "return_routed_experts"],
    ),
    *_mutations(
        "/v1/completions",
        {"prompt": "ab", "max_tokens": 1, "logprobs": 1},
        ["prompt", "max_tokens", "min_tokens", "temperature", "top_p", "top_k", "n", "stop",
         "stop_token_ids", "logprobs", "stream", "stream_options"],
    ),
    *_mutations(
        CHAT, chat(max_tokens=1, logprobs=True),
        ["messages", "top_logprobs", "max_completion_tokens"],
    ),
    *[
        (CHAT, f'{{"max_tokens": 1, "messages": [{message}]}}'.encode())
        for literal in map(_literal, VALUES)
        for message in [
            f'{{"role": "user", "content": {literal}}}',
            f'{{"role": {literal}, "content": "a"}}',
            f'{{"role": "user", "content": [{{"type": "text", "text": {literal}}}]}}',
            f'{{"role": "user", "content": [{{"type": {literal}}}]}}',
        ]
    ],
    *_mutations("/update_weight_version", {"abort_all_requests": False}, ["new_version"]),
    *_mutations("/update_weights_from_disk", {"weight_version": 1}, ["model_path"]),
    *_mutations("/update_weights_from_disk", {"model_path": "/nowhere"}, ["weight_version"]),
    *_mutations("/unload_lora_adapter", {}, ["lora_name"]),
    *_mutations("/load_lora_adapter", {"lora_path": "/nowhere"}, ["lora_name", "lora_path"]),
    *_mutations("/destroy_weights_update_group", {}, ["group_name"]),
    *_mutations("/update_weights_from_distributed", {}, ["group_name"]),
    *_mutations(
        "/init_weights_update_group",
        {"rank_offset": 1, "world_size": 2, "backend": "gloo", "master_address": "127.0.0.1",
         "master_port": 1},
        ["rank_offset", "world_size", "master_port"],
    ),
]  # fmt: skip


def test_no_malformed_field_answers_a_5xx(served: str) -> None:
    """Every field of the request endpoints set to each of `VALUES`: a 200 or a 4xx, never a
    5xx (the valid ones among them generate one token)."""
    answered = [(path, raw, send(served, path, raw)) for path, raw in FUZZ]
    server_errors = [(path, raw[:120], error) for path, raw, (st, error) in answered if st >= 500]
    assert not server_errors
    assert {st for _, _, (st, _) in answered} <= {200, 400}
