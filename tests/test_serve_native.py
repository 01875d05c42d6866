"""`asyncrl serve` (a real process on a random tiny model) against SGLang 0.5.23's native API, over
plain HTTP: text and ids, batches, `n`, stop strings and ids, `ignore_eos`, `min_new_tokens`,
log-prob options, SSE, both endpoint names, and 400s that name what is not supported."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from asyncrl.tiny_model import EOS_ID


@pytest.fixture(scope="module")
def random_model(chat_model: Path) -> Path:
    """The module's `served` runs the model whose tokenizer spells text."""
    return chat_model


def post(url: str, path: str, body: Any = None) -> tuple[int, Any]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url + path, data=data)
    request.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(request, timeout=60) as reply:
            raw = reply.read().decode()
            kind = reply.headers.get("Content-Type", "")
            status = reply.status
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())
    if kind == "text/event-stream":
        return status, raw
    return status, json.loads(raw) if kind == "application/json" else raw


def generate(url: str, **body: Any) -> Any:
    status, reply = post(url, "/generate", body)
    assert status == 200, reply
    return reply


GREEDY = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}


def test_text_ids_batches_and_n(served: str, random_model: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(random_model)
    one = generate(served, text="ab c", sampling_params=GREEDY)
    assert set(one) == {"text", "output_ids", "meta_info"}
    ids = tokenizer.encode("ab c")
    assert one["meta_info"]["prompt_tokens"] == len(ids)  # encoded with <bos>, as SGLang does
    assert (
        generate(served, input_ids=ids, sampling_params=GREEDY)["output_ids"] == one["output_ids"]
    )
    assert one["text"] == tokenizer.decode(one["output_ids"], skip_special_tokens=True)
    meta = one["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 12}
    assert meta["completion_tokens"] == 12 and isinstance(meta["id"], str)
    assert meta["weight_version"] == "0" and meta["cached_tokens"] == 0

    batch = generate(served, text=["ab c", "xy"], sampling_params=GREEDY)
    assert batch[0]["output_ids"] == one["output_ids"] and len(batch) == 2
    # n copies each prompt, copies adjacent; a single prompt with n > 1 answers a list.
    many = generate(
        served,
        input_ids=[ids, tokenizer.encode("xy")],
        sampling_params={"n": 3, "max_new_tokens": 4},
    )
    assert [m["meta_info"]["prompt_tokens"] for m in many] == [len(ids)] * 3 + [3] * 3
    assert len({m["meta_info"]["id"] for m in many}) == 6
    assert len(generate(served, text="ab", sampling_params={"n": 2, "max_new_tokens": 2})) == 2
    # Per-prompt sampling params; max_new_tokens 0 (the frontend caches prefixes so).
    mixed = generate(
        served, text=["a", "b"], sampling_params=[{"max_new_tokens": 0}, {"max_new_tokens": 3}]
    )
    assert [len(m["output_ids"]) for m in mixed] == [0, 3]
    assert mixed[0]["meta_info"]["finish_reason"] == {"type": "length", "length": 0}


def test_stop_token_ids_add_to_eos_ignore_eos_and_special_tokens(served: str) -> None:
    # Hot sampling over many rows: EOS and the extra stop id both turn up (the server's sampler
    # is seeded, so the figures are the same on every run).
    prompts = [[1, 3 + i % 40] for i in range(48)]
    hot = {"temperature": 3.0, "max_new_tokens": 30, "stop_token_ids": [5]}
    outs = generate(
        served,
        input_ids=prompts,
        sampling_params=hot | {"no_stop_trim": True, "skip_special_tokens": False},
    )
    ends = [o["meta_info"]["finish_reason"].get("matched") for o in outs]
    assert EOS_ID in ends and 5 in ends  # EOS still stops beside the listed id
    for out, end in zip(outs, ends, strict=True):
        ids = out["output_ids"]
        assert EOS_ID not in ids[:-1] and 5 not in ids[:-1]
        assert end == ids[-1] or (end is None and len(ids) == 30)
        if end == EOS_ID:
            assert out["text"].endswith("<eos>")  # special tokens kept when asked
    trimmed = generate(served, input_ids=prompts, sampling_params=hot)
    assert not any("<" in o["text"] for o in trimmed)
    # ignore_eos: only the listed id stops; EOS may come anywhere.
    outs = generate(served, input_ids=prompts, sampling_params=hot | {"ignore_eos": True})
    assert any(EOS_ID in o["output_ids"][:-1] for o in outs)
    assert all(5 not in o["output_ids"][:-1] for o in outs)


def test_min_new_tokens_masks_the_stop_tokens(served: str, random_model: Path) -> None:
    vocab = AutoModelForCausalLM.from_pretrained(random_model).config.vocab_size
    keep = 7  # every other token stops: for 5 steps only token 7 can be drawn
    stops = [t for t in range(vocab) if t != keep]
    out = generate(
        served,
        input_ids=[1, 5, 6],
        sampling_params={"max_new_tokens": 8, "min_new_tokens": 5, "stop_token_ids": stops},
        return_logprob=True,
    )
    ids = out["output_ids"]
    assert ids[:5] == [keep] * 5 and len(ids) >= 6
    # Log-probs are of the masked distribution: the only token left is certain.
    assert [t[0] for t in out["meta_info"]["output_token_logprobs"][:5]] == [0.0] * 5
    plain = generate(
        served, input_ids=[1, 5, 6], sampling_params={"max_new_tokens": 8, "stop_token_ids": stops}
    )["output_ids"]
    assert plain[:-1] == [keep] * (len(plain) - 1)  # without it, the first other token stops


def test_stop_strings_end_and_trim(served: str, random_model: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(random_model)
    free = generate(served, text="hello", sampling_params=GREEDY | {"max_new_tokens": 20})
    text = free["text"]
    stop = text[5:7]
    cut = text.find(stop)
    out = generate(
        served, text="hello", sampling_params=GREEDY | {"max_new_tokens": 20, "stop": stop}
    )
    assert out["text"] == text[:cut]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    # Generation ends at the token that completes the stop string.
    ends = [
        k
        for k in range(21)
        if stop in tokenizer.decode(free["output_ids"][:k], skip_special_tokens=True)
    ]
    assert out["output_ids"] == free["output_ids"][: ends[0]]
    kept = generate(
        served,
        text="hello",
        sampling_params=GREEDY
        | {"max_new_tokens": 20, "stop": ["zzzz", stop], "no_stop_trim": True},
    )
    assert kept["text"] == text[: cut + len(stop)]


@torch.no_grad()
def test_logprobs_input_output_and_top(served: str, random_model: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(random_model).eval()
    prompt = [1, 9, 4, 12, 30]
    out = generate(
        served,
        input_ids=prompt,
        sampling_params={"temperature": 0.7, "max_new_tokens": 6},
        return_logprob=True,
        logprob_start_len=0,
        top_logprobs_num=3,
        return_text_in_logprobs=True,
    )
    meta = out["meta_info"]
    ids = out["output_ids"]
    logits = model(input_ids=torch.tensor([prompt + ids])).logits[0, :-1]
    ref = torch.log_softmax(logits / 0.7, -1)
    inputs = meta["input_token_logprobs"]
    assert [t[1] for t in inputs] == prompt and inputs[0][0] is None
    for i in range(1, len(prompt)):
        assert inputs[i][0] == pytest.approx(ref[i - 1, prompt[i]].item(), abs=1e-4)
    outputs = meta["output_token_logprobs"]
    assert [t[1] for t in outputs] == ids and all(isinstance(t[2], str) for t in outputs)
    for t, (lp, tok, _) in enumerate(outputs):
        assert lp == pytest.approx(ref[len(prompt) - 1 + t, tok].item(), abs=1e-4)
    top = meta["output_top_logprobs"]
    assert len(top) == len(ids) and all(len(entry) == 3 for entry in top)
    for t, entry in enumerate(top):
        values, alts = ref[len(prompt) - 1 + t].topk(3)
        assert [e[1] for e in entry] == alts.tolist()
        assert [e[0] for e in entry] == pytest.approx(values.tolist(), abs=1e-4)
    assert meta["input_top_logprobs"][0] is None and len(meta["input_top_logprobs"]) == 5
    # logprob_start_len -1 (the default): the last prompt token only; no text unless asked.
    short = generate(
        served, input_ids=prompt, sampling_params={"max_new_tokens": 2}, return_logprob=True
    )["meta_info"]
    assert len(short["input_token_logprobs"]) == 1 and short["input_token_logprobs"][0][1] == 30
    assert short["output_token_logprobs"][0][2] is None and "output_top_logprobs" not in short


def _events(raw: str) -> list[Any]:
    lines = [line for line in raw.split("\n") if line]
    assert all(line.startswith("data: ") for line in lines) and lines[-1] == "data: [DONE]"
    return [json.loads(line[6:]) for line in lines[:-1]]


def test_stream_sends_sse_like_sglang(served: str) -> None:
    body = {"text": "hello", "sampling_params": GREEDY | {"stop": "zz"}, "return_logprob": True}
    whole = generate(served, **body)
    status, raw = post(served, "/generate", body | {"stream": True})
    assert status == 200
    chunks = _events(raw)
    assert len(chunks) == 12
    last = chunks[-1]
    assert last["text"] == whole["text"] and last["output_ids"] == whole["output_ids"]
    assert last["meta_info"]["finish_reason"] == whole["meta_info"]["finish_reason"]
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])
    for t, chunk in enumerate(chunks):  # cumulative, as SGLang streams by default
        assert chunk["output_ids"] == whole["output_ids"][: t + 1]
        assert whole["text"].startswith(chunk["text"])
        assert len(chunk["meta_info"]["output_token_logprobs"]) == t + 1
    status, raw = post(
        served,
        "/generate",
        {"text": ["a", "b"], "sampling_params": {"max_new_tokens": 2}, "stream": True},
    )
    assert sorted({c["index"] for c in _events(raw)}) == [0, 1]


def test_info_endpoints_under_both_names(served: str, random_model: Path) -> None:
    for new, old in (("/model_info", "/get_model_info"), ("/server_info", "/get_server_info")):
        status, reply = post(served, new)
        assert status == 200 and reply == post(served, old)[1]
    info = post(served, "/model_info")[1]
    assert info["model_path"] == str(random_model) and info["is_generation"] is True
    assert post(served, "/server_info")[1]["api_version"] == "0.5.23"
    assert post(served, "/flush_cache", {})[0] == 200
    assert post(served, "/health")[0] == 200 and post(served, "/health_generate")[0] == 200


@pytest.mark.parametrize(
    ("body", "named"),
    [
        ({"text": "a", "sampling_params": {"regex": "a+"}}, "regex"),
        ({"text": "a", "sampling_params": {"frequency_penalty": 0.5}}, "frequency_penalty"),
        ({"text": "a", "sampling_params": {"nonsense": 1}}, "nonsense"),
        ({"text": "a", "lora_path": 3}, "lora_path"),
        ({"text": "a", "lora_path": "x", "sampling_params": {"max_new_tokens": 2}}, "loaded: x"),
        ({"text": "a", "foo": 1, "bar": None}, "bar, foo"),
        ({"text": "a", "input_ids": [1]}, "exactly one of text and input_ids"),
        ({"input_ids": [1, 999]}, "input_ids"),
        ({"text": "a", "sampling_params": {"min_new_tokens": 9, "max_new_tokens": 3}}, "min_new"),
        ({"text": "a", "sampling_params": {"top_k": 0}}, "top_k"),
        ({"text": "a", "sampling_params": {"max_new_tokens": 10**6}}, "context"),
    ],
)
def test_unsupported_or_bad_parameters_are_refused(
    served: str, body: dict[str, Any], named: str
) -> None:
    status, reply = post(served, "/generate", body)
    assert status == 400 and named in reply["message"], reply
    assert reply["object"] == "error" and reply["code"] == 400


def test_neutral_values_are_accepted(served: str) -> None:
    # What SGLang's frontend sends with every gen: every key, most at a neutral value.
    neutral = {
        "min_p": 0.0,
        "frequency_penalty": 0.0,
        "presence_penalty": 0.0,
        "regex": None,
        "json_schema": None,
        "stop_regex": [],
        "spaces_between_special_tokens": True,
        "max_new_tokens": 2,
    }
    assert (
        len(generate(served, text="a", sampling_params=neutral, image_data=None)["output_ids"]) == 2
    )
