"""`asyncrl serve`'s OpenAI-compatible API driven by the `openai` package: models, completions,
chat completions (the tokenizer's chat template) with log-probs, `n`, `stop`, streaming, usage,
and errors in OpenAI's shape."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

openai = pytest.importorskip("openai")


@pytest.fixture(scope="module")
def random_model(chat_model: Path) -> Path:
    return chat_model


@pytest.fixture(scope="module")
def client(served: str) -> Any:
    return openai.OpenAI(base_url=served + "/v1", api_key="x", max_retries=0)


def test_models_list(client: Any, random_model: Path) -> None:
    assert [m.id for m in client.models.list()] == [str(random_model)]


def test_completions(client: Any, random_model: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(random_model)
    name = str(random_model)
    out = client.completions.create(
        model=name, prompt="hello", max_tokens=8, temperature=0, logprobs=2
    )
    choice = out.choices[0]
    assert out.usage.prompt_tokens == len(tokenizer.encode("hello"))
    assert out.usage.completion_tokens == len(choice.logprobs.tokens) <= 8
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens
    assert "".join(choice.logprobs.tokens).startswith(choice.text)
    for lp, top in zip(choice.logprobs.token_logprobs, choice.logprobs.top_logprobs, strict=True):
        assert lp == 0.0 and len(top) == 2  # greedy: the drawn token is certain
    assert choice.finish_reason in ("stop", "length")
    many = client.completions.create(model=name, prompt=["a", "b"], max_tokens=3, n=2)
    assert [c.index for c in many.choices] == [0, 1, 2, 3]
    assert many.usage.prompt_tokens == 4 and many.usage.completion_tokens <= 12  # <bos> + 1 each
    free = client.completions.create(
        model=name, prompt="hello", max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
    ).choices[0]
    stop = free.text[3:5]
    cut = client.completions.create(
        model=name, prompt="hello", max_tokens=12, temperature=0, stop=[stop],
        extra_body={"ignore_eos": True},
    ).choices[0]  # fmt: skip
    assert cut.text == free.text[: free.text.find(stop)] and cut.finish_reason == "stop"


def test_chat_completions_with_logprobs(client: Any, random_model: Path) -> None:
    name = str(random_model)
    messages = [{"role": "user", "content": "hi there"}]
    out = client.chat.completions.create(
        model=name, messages=messages, max_tokens=6, logprobs=True, top_logprobs=3, temperature=0.8
    )
    tokenizer = AutoTokenizer.from_pretrained(random_model)
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert prompt == "user: hi there\nassistant: "
    assert out.usage.prompt_tokens == len(tokenizer.encode(prompt, add_special_tokens=False))
    choice = out.choices[0]
    assert choice.message.role == "assistant"
    content = choice.logprobs.content
    assert len(content) == out.usage.completion_tokens
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob >= entry.logprob - 1e-5
        assert entry.bytes == list(entry.token.encode())
    two = client.chat.completions.create(model=name, messages=messages, max_tokens=2, n=2)
    assert len(two.choices) == 2 and two.usage.completion_tokens <= 4


def test_streaming(client: Any, random_model: Path) -> None:
    name = str(random_model)
    whole = client.completions.create(model=name, prompt="abc", max_tokens=8, temperature=0)
    chunks = list(
        client.completions.create(
            model=name,
            prompt="abc",
            max_tokens=8,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[
        0
    ].finish_reason
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    messages = [{"role": "user", "content": "yo"}]
    reply = client.chat.completions.create(
        model=name, messages=messages, max_tokens=5, temperature=0
    )
    parts = list(
        client.chat.completions.create(
            model=name, messages=messages, max_tokens=5, temperature=0, stream=True, logprobs=True
        )
    )
    assert parts[0].choices[0].delta.role == "assistant"
    assert (
        "".join(p.choices[0].delta.content or "" for p in parts) == reply.choices[0].message.content
    )
    streamed = [e for p in parts if p.choices[0].logprobs for e in p.choices[0].logprobs.content]
    assert len(streamed) == reply.usage.completion_tokens


def test_errors_in_openai_shape(client: Any, random_model: Path) -> None:
    name = str(random_model)
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(model=name, prompt="a", extra_body={"regex": "a+"})
    assert exc.value.body["param"] == "regex" and "regex" in exc.value.body["message"]
    assert exc.value.body["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError, match="presence_penalty"):
        client.chat.completions.create(
            model=name, messages=[{"role": "user", "content": "a"}], presence_penalty=1.0
        )
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model=name, input="a")


def test_responses_plain_and_streamed(client: Any, random_model: Path) -> None:
    """`/v1/responses` (the Agents SDK's default API) answers what chat answers, whole or as
    stream events ending in the same `Response`, with the sampled tokens' log-probs."""
    name = str(random_model)
    messages = [{"role": "user", "content": "yo"}]
    chat = client.chat.completions.create(
        model=name, messages=messages, max_tokens=5, temperature=0
    )
    text = chat.choices[0].message.content
    ask = {"model": name, "input": "yo", "max_output_tokens": 5, "temperature": 0}
    whole = client.responses.create(**ask, include=["message.output_text.logprobs"])
    assert whole.output_text == text
    assert len(whole.output[0].content[0].logprobs) == chat.usage.completion_tokens
    assert whole.usage.output_tokens == chat.usage.completion_tokens
    events = list(client.responses.create(**ask, stream=True))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == text and events[-1].response.output_text == text
