"""`asyncrl serve` driven by SGLang's own client code: `sglang.RuntimeEndpoint` and the frontend
(`@sgl.function`, `sgl.gen`, `sgl.select`) through `sgl.set_default_backend`. SGLang is
installed without its heavy dependencies (`.ci/run`; README "Tests"); without it these skip."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path
from typing import Any

import pytest

sgl = pytest.importorskip("sglang", reason="SGLang's client: see .ci/run for its install")


@pytest.fixture(scope="module")
def random_model(chat_model: Path) -> Path:
    return chat_model


@pytest.fixture(scope="module")
def endpoint(served: str) -> Any:
    backend = sgl.RuntimeEndpoint(served)
    sgl.set_default_backend(backend)
    return backend


def _generate(url: str, body: dict[str, Any]) -> Any:
    request = urllib.request.Request(
        url + "/generate", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=60) as reply:
        return json.loads(reply.read())


def test_runtime_endpoint_info_and_cache(endpoint: Any, random_model: Path) -> None:
    assert endpoint.get_model_name() == str(random_model)
    info = endpoint.get_server_info()
    assert info["api_version"] == "0.5.23" and info["tp_size"] == 1
    endpoint.flush_cache()
    endpoint.cache_prefix("hello")  # a text /generate with max_new_tokens 0


@sgl.function
def _answer(s: Any, question: str) -> None:
    s += question
    s += sgl.gen("answer", max_tokens=10, temperature=0, stop="q")


def test_frontend_gen_matches_the_native_api(endpoint: Any, served: str) -> None:
    state = _answer.run(question="what is ")
    reply = _generate(
        served,
        {
            "text": "what is ",
            "sampling_params": {"max_new_tokens": 10, "temperature": 0, "stop": "q"},
        },
    )
    assert state["answer"] == reply["text"]
    assert state.get_meta_info("answer")["completion_tokens"] == len(reply["output_ids"])
    states = _answer.run_batch([{"question": "a"}, {"question": "b"}])
    assert [s["answer"] for s in states] == [
        _generate(
            served,
            {"text": q, "sampling_params": {"max_new_tokens": 10, "temperature": 0, "stop": "q"}},
        )["text"]
        for q in ("a", "b")
    ]


def test_frontend_stream_gives_the_same_text(endpoint: Any) -> None:
    whole = _answer.run(question="hi ")["answer"]
    state = _answer.run(question="hi ", stream=True)
    assert "".join(state.text_iter("answer")) == whole


@sgl.function
def _with_logprobs(s: Any) -> None:
    s += "abc"
    s += sgl.gen(
        "x",
        max_tokens=4,
        return_logprob=True,
        top_logprobs_num=2,
        return_text_in_logprobs=True,
        logprob_start_len=0,
    )


def test_frontend_logprob_options(endpoint: Any) -> None:
    meta = _with_logprobs.run().get_meta_info("x")
    assert len(meta["output_token_logprobs"]) == meta["completion_tokens"]
    assert all(len(entry) == 2 for entry in meta["output_top_logprobs"])
    assert meta["input_token_logprobs"][0][0] is None
    assert all(isinstance(t[2], str) for t in meta["output_token_logprobs"])


@sgl.function
def _choose(s: Any) -> None:
    s += "pick: "
    s += sgl.select("pick", choices=["yes", "no"])


def test_frontend_select_scores_the_choices(endpoint: Any) -> None:
    assert _choose.run()["pick"] in ("yes", "no")
