"""`asyncrl serve` (a subprocess on a free loopback port, random tiny model) driven through the
SGLang engine client and the SGLang weight publisher, as a real SGLang server would be."""

from __future__ import annotations

import threading
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import redis
import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from asyncrl.engines.config import SamplingParams
from asyncrl.engines.sampling import sampling_logprobs
from asyncrl.launch.redis_server import free_port
from asyncrl.runstate import Keys
from asyncrl.sglang.client import RequestFailure, http_json
from asyncrl.sglang.config import SglangEngineConfig, SglangWeightsConfig
from asyncrl.sglang.engine import SglangEngine
from asyncrl.sglang.publisher import SglangPublisher, SglangSubscriber

from role_procs import wait_until

PROMPTS = [[1, 4, 5, 13], [1, 7], [1, 3, 9, 13, 8, 8, 14], [1]]
PARAMS = SamplingParams(max_new_tokens=10)
KEYS = Keys("serve-test")


def _engine(url: str, **overrides: object) -> SglangEngine:
    cfg = SglangEngineConfig.model_validate({"urls": [url], "backoff_s": 0.05, **overrides})
    return SglangEngine.from_config(cfg, model_path="unused")


@torch.no_grad()
def _reference(model: PreTrainedModel, prompt: list[int], response: np.ndarray) -> np.ndarray:
    """Log-probs of `response` from one unpadded full forward pass, as the trainer computes them."""
    ids = torch.tensor([prompt + response.tolist()])
    logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1]
    logp = sampling_logprobs(logits, PARAMS)
    return logp.gather(-1, torch.from_numpy(response).long()[:, None])[:, 0].numpy()


def _check_exact(engine: SglangEngine, model: PreTrainedModel, version: int) -> None:
    gens = engine.generate(PROMPTS * 2, PARAMS)
    for prompt, gen in zip(PROMPTS * 2, gens, strict=True):
        assert (gen.versions == version).all()
        np.testing.assert_allclose(
            gen.logprobs, _reference(model, prompt, gen.token_ids), atol=1e-5
        )


def test_generation_is_exact_at_lag_0(served: str, random_model: Path) -> None:
    engine = _engine(served, chunk_size=3)
    model = AutoModelForCausalLM.from_pretrained(random_model).eval()
    version = engine.version
    _check_exact(engine, model, version)
    gens = engine.generate(PROMPTS, PARAMS)
    assert all(len(g.token_ids) == len(g.logprobs) == len(g.versions) >= 1 for g in gens)
    engine.close()


def _perturb(model: PreTrainedModel, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))


@pytest.mark.parametrize("transport", ["broadcast", "store"])
def test_weight_updates_through_the_publisher(
    served: str, random_model: Path, redis_client: redis.Redis, tmp_path: Path, transport: str
) -> None:
    engine = _engine(served)
    model = AutoModelForCausalLM.from_pretrained(random_model).eval()
    weights = SglangWeightsConfig.model_validate(
        {
            "transport": transport,
            "sync_timeout_s": 20,
            "store_dir": str(tmp_path / "w"),
            "pause_mode": "retract",
        }
    )
    subscriber = SglangSubscriber(weights, redis_client, KEYS, "w0", [served])
    publisher = SglangPublisher(weights, redis_client, KEYS, torch.device("cpu"))
    try:
        start = engine.version  # the module's server may hold updates of an earlier test
        # Broadcast takes two versions: the second must reuse the group the first formed.
        steps = (1, 2) if transport == "broadcast" else (1,)
        for step in steps:
            _perturb(model, seed=step)
            publisher.publish(model, start + step)
            assert subscriber.wait_for_version(start + step, timeout_s=30) == start + step
            _check_exact(engine, model, start + step)
        # The publisher counts a send once it has returned, which may be after the subscriber
        # has the version.
        wait_until(lambda: publisher.stats().sent >= len(steps), 30, "sends counted")
        stats = publisher.stats()
        assert stats.sent == len(steps) and stats.failed == 0
        assert stats.rebuilds == 0  # one group for both versions
    finally:
        publisher.close()
        subscriber.close()
        engine.close()


def test_pause_holds_and_abort_is_retried(served: str) -> None:
    engine = _engine(served, retries=5)
    http_json(served, "/pause_generation", {"mode": "in_place"}, timeout_s=5)
    done = threading.Event()
    results: list[object] = []

    def generate() -> None:
        results.append(engine.generate([[1, 4]], PARAMS))
        done.set()

    thread = threading.Thread(target=generate)
    thread.start()
    try:
        assert not done.wait(0.5)  # held between two decode steps
        # An abort ends the held request; the client's retry then waits for the continue.
        http_json(served, "/pause_generation", {"mode": "abort"}, timeout_s=5)
        assert not done.wait(0.5)
    finally:
        http_json(served, "/continue_generation", {}, timeout_s=5)
    assert done.wait(30)
    thread.join()
    assert len(results) == 1
    engine.close()


def _status(url: str, path: str) -> int:
    with urllib.request.urlopen(url + path, timeout=30) as reply:
        return int(reply.status)


def test_info_health_and_errors(served: str) -> None:
    info = http_json(served, "/get_server_info", timeout_s=5)
    assert info["api_version"] == "0.5.23" and info["tp_size"] == 1
    assert "weight_version" in http_json(served, "/get_model_info", timeout_s=5)
    assert [_status(served, p) for p in ("/health", "/health_generate", "/flush_cache")] == [
        200
    ] * 3
    single = http_json(
        served,
        "/generate",
        {"input_ids": [1, 4], "sampling_params": {"max_new_tokens": 2}, "return_logprob": True},
        timeout_s=30,
    )
    assert isinstance(single, dict) and len(single["meta_info"]["output_token_logprobs"]) >= 1
    for path, body in [
        ("/pause_generation", {"mode": "sideways"}),
        ("/update_weights_from_disk", {"model_path": "/nonexistent", "weight_version": "99"}),
        ("/update_weights_from_distributed", {"group_name": "none", "weight_version": "99"}),
        ("/generate", {"input_ids": []}),
    ]:
        with pytest.raises(RequestFailure) as bad:
            http_json(served, path, body, timeout_s=5)
        assert bad.value.status == 400, path
    with pytest.raises(RequestFailure) as missing:
        http_json(served, "/no_such_endpoint", timeout_s=5)
    assert missing.value.status == 404


def test_a_weight_update_group_at_a_closed_port_is_refused_at_once(served: str) -> None:
    # The trainer that asked has gone: nothing listens at its store's port. The store client
    # alone would retry for over two minutes, holding the request (and a handler thread).
    port = free_port()
    body = {
        "master_address": "127.0.0.1",
        "master_port": port,
        "rank_offset": 1,
        "world_size": 2,
        "group_name": "gone",
        "backend": "gloo",
    }
    for _ in range(2):  # nothing of the failed group is left behind: refused alike again
        with pytest.raises(RequestFailure) as refused:
            http_json(served, "/init_weights_update_group", body, timeout_s=30)
        assert refused.value.status == 400, refused.value
        assert f"cannot reach the trainer's store at 127.0.0.1:{port}" in refused.value.detail
