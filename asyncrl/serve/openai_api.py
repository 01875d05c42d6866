"""OpenAI-compatible `/v1/models`, `/v1/completions` and `/v1/chat/completions` for `asyncrl serve`.

Requests become the same jobs as SGLang's native `/generate` (`asyncrl.serve.native`), with
OpenAI's names mapped onto SGLang's (`max_tokens` → `max_new_tokens`, `min_tokens` →
`min_new_tokens`) and SGLang's extensions accepted as its OpenAI server does (`top_k`,
`ignore_eos`, `stop_token_ids`, `skip_special_tokens`, `no_stop_trim`). Chat prompts are made
with the tokenizer's chat template; a tokenizer without one is refused. Replies, SSE chunks and
`usage` take OpenAI's shapes; errors are OpenAI's `{"error": {...}}`.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from asyncrl.serve.native import (
    ApiError,
    Body,
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
CHAT_KEYS = COMMON_KEYS | {"messages", "max_completion_tokens", "top_logprobs"}
CHAT_NEUTRAL = COMMON_NEUTRAL | {
    "tools": None,
    "tool_choice": "none",
    "parallel_tool_calls": None,
    "chat_template_kwargs": None,
    "continue_final_message": False,
    "separate_reasoning": True,
}
# Our key (SGLang's native name) → the request's own.
NAMES = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens"}
MAX_MESSAGES = 4096
"""The most messages a chat request may hold: refused before the chat template renders them."""


@dataclass(frozen=True)
class OpenAIRequest:
    chat: bool
    jobs: list[Job]
    prompts: list[list[int]]
    logprobs: int | None
    """Alternatives per token when log-probs are asked for (0: only the sampled token's)."""
    stream: bool
    include_usage: bool


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


def _message_text(message: Any) -> dict[str, str]:
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise ApiError("messages: each needs a role and content", "messages")
    content = message.get("content")
    if isinstance(content, list):  # content parts: text only here
        if not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
            raise ApiError("messages: only text content parts are supported", "messages")
        content = "".join(str(p.get("text", "")) for p in content)
    if not isinstance(content, str):
        raise ApiError("messages: content must be a string or text parts", "messages")
    return {"role": message["role"], "content": content}


def parse_chat(body: Body, model: Model) -> OpenAIRequest:
    refuse_unknown(body, CHAT_KEYS, CHAT_NEUTRAL, "parameters")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError("messages: a non-empty list", "messages")
    if len(messages) > MAX_MESSAGES:
        raise ApiError(f"messages: {len(messages)} is over {MAX_MESSAGES}", "messages")
    tokenizer = model.tokenizer
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise ApiError("the model's tokenizer has no chat template", "messages")
    text = tokenizer.apply_chat_template(
        [_message_text(m) for m in messages], add_generation_prompt=True, tokenize=False
    )
    prompt = model.check_ids(list(tokenizer.encode(text, add_special_tokens=False)), "messages")
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
    return _request(body, [prompt], raw, logprobs, model, chat=True)


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


def _choice(req: OpenAIRequest, index: int, text: str, logprobs: Any, out: Output | None) -> Any:
    finish = None if out is None else _finish_reason(out)
    matched = None if out is None else out.finish.get("matched")
    if req.chat:
        return {
            "index": index,
            "message": {"role": "assistant", "content": text},
            "logprobs": logprobs,
            "finish_reason": finish,
            "matched_stop": matched,
        }
    return {
        "index": index,
        "text": text,
        "logprobs": logprobs,
        "finish_reason": finish,
        "matched_stop": matched,
    }


def reply(req: OpenAIRequest, outs: list[Output], model: Model, name: str) -> Any:
    """The whole reply, or for `stream` the iterator of its SSE chunks."""
    head = {
        "id": ("chatcmpl-" if req.chat else "cmpl-") + uuid.uuid4().hex,
        "object": "chat.completion" if req.chat else "text_completion",
        "created": int(time.time()),
        "model": name,
    }
    if req.stream:
        return _chunks(req, outs, model, head)
    choices = [
        _choice(req, i, out.text, _token_logprobs(req, job, out, model), out)
        for i, (job, out) in enumerate(zip(req.jobs, outs, strict=True))
    ]
    return head | {"choices": choices, "usage": _usage(req, outs)}


def _chunks(
    req: OpenAIRequest, outs: list[Output], model: Model, head: dict[str, Any]
) -> Iterator[dict[str, Any]]:
    if req.chat:
        head = head | {"object": "chat.completion.chunk"}
    for index, (job, out) in enumerate(zip(req.jobs, outs, strict=True)):
        if req.chat:
            role = {"index": index, "delta": {"role": "assistant", "content": ""}}
            yield head | {"choices": [role | {"logprobs": None, "finish_reason": None}]}
        shown, done = 0, 0
        for stage, last in prefixes(out, model, job.spec):
            delta = stage.text[shown:]
            shown = len(stage.text)
            logprobs = _token_logprobs(req, job, out, model, done)
            if logprobs is not None:  # this chunk's tokens only
                end = len(stage.tokens) - done
                logprobs = {k: v[:end] for k, v in logprobs.items()}
            done = len(stage.tokens)
            finish = _finish_reason(out) if last else None
            if req.chat:
                choice = {"index": index, "delta": {"content": delta}}
            else:
                choice = {"index": index, "text": delta}
            yield head | {
                "choices": [choice | {"logprobs": logprobs, "finish_reason": finish}],
            }
    if req.include_usage:
        yield head | {"choices": [], "usage": _usage(req, outs)}
