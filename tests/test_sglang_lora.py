"""LoRA with SGLang servers (`model.lora` + `rollout.engine.type: sglang`), against `asyncrl serve`
as the SGLang server: its adapter endpoints, the publisher's load → rename → unload switch, the
engine naming its server's adapter and stamping its version, a restarted server, and a run whose
lag-0 log-probs are the trainer's (`test_sglang_e2e.py`, with `model.lora`)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import redis
import torch
from test_sglang_e2e import run_sglang

from asyncrl.engines.sampling import SamplingParams
from asyncrl.launch.redis_server import free_port
from asyncrl.lora import synced, wrap, write_adapter
from asyncrl.model_config import LoraConfig
from asyncrl.runstate import Keys
from asyncrl.sglang.client import RequestFailure, http_json, lora_flags
from asyncrl.sglang.config import SglangEngineConfig, SglangWeightsConfig
from asyncrl.sglang.engine import SglangEngine
from asyncrl.sglang.publisher import SglangPublisher, SglangSubscriber

from engine_helpers import PROMPTS, load_model, reference_logprobs
from role_procs import RoleConfig, wait_until

LORA = LoraConfig(rank=4, alpha=8, target_modules=["q_proj", "v_proj", "down_proj"])
PARAMS = SamplingParams(max_new_tokens=8)


def lora_model(random_model: Path, seed: int) -> torch.nn.Module:
    """The random model with an adapter moved away from its init (B = 0 adds nothing)."""
    model = wrap(load_model(random_model), LORA)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in synced(model):
            p.add_(0.2 * torch.randn(p.shape, generator=g))
    return model.eval()


def check_exact(gens: list, model: torch.nn.Module, prompts: list[list[int]]) -> None:  # type: ignore[type-arg]
    for prompt, gen in zip(prompts, gens, strict=True):
        expected = reference_logprobs(model, prompt, gen.token_ids, PARAMS)  # type: ignore[arg-type]
        np.testing.assert_allclose(gen.logprobs, expected, rtol=0, atol=1e-5)


def post(url: str, path: str, body: dict) -> Any:  # type: ignore[type-arg]
    return http_json(url, path, body, timeout_s=30)


def generate(url: str, lora: str | None) -> dict:  # type: ignore[type-arg]
    body = {
        "input_ids": PROMPTS[2],
        "sampling_params": {"max_new_tokens": 6, "temperature": 1.0},
        "return_logprob": True,
        "lora_path": lora,
    }
    return post(url, "/generate", body)  # type: ignore[no-any-return]


def test_adapters_load_unload_and_unknown_names(
    served: str, random_model: Path, tmp_path: Path
) -> None:
    model = lora_model(random_model, seed=1)
    write_adapter(tmp_path / "a1", dict(synced(model)), LORA)
    reply = post(
        served, "/load_lora_adapter", {"lora_name": "a1", "lora_path": str(tmp_path / "a1")}
    )
    assert reply["success"] and reply["loaded_adapters"] == {"a1": str(tmp_path / "a1")}
    with pytest.raises(RequestFailure, match="already loaded"):
        post(served, "/load_lora_adapter", {"lora_name": "a1", "lora_path": "x"})

    # Generated with the adapter: the trainer's log-probs; without it: the base's.
    out = generate(served, "a1")
    response = np.array([t[1] for t in out["meta_info"]["output_token_logprobs"]])
    logp = [t[0] for t in out["meta_info"]["output_token_logprobs"]]
    expected = reference_logprobs(model, PROMPTS[2], response, PARAMS)  # type: ignore[arg-type]
    np.testing.assert_allclose(logp, expected, rtol=0, atol=1e-5)
    base = generate(served, None)
    response = np.array([t[1] for t in base["meta_info"]["output_token_logprobs"]])
    with model.disable_adapter():
        expected = reference_logprobs(model, PROMPTS[2], response, PARAMS)  # type: ignore[arg-type]
    logp = [t[0] for t in base["meta_info"]["output_token_logprobs"]]
    np.testing.assert_allclose(logp, expected, rtol=0, atol=1e-5)

    with pytest.raises(RequestFailure, match="never been loaded: nope") as err:
        generate(served, "nope")
    assert err.value.status == 400

    assert post(served, "/unload_lora_adapter", {"lora_name": "a1"})["loaded_adapters"] == {}
    with pytest.raises(RequestFailure, match="does not exist"):
        post(served, "/unload_lora_adapter", {"lora_name": "a1"})
    # As SGLang: an adapter unloaded since is loaded again from its path when a request names it.
    assert generate(served, "a1")["meta_info"]["completion_tokens"] == 6


def serve(model: Path, port: int, log: Path) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "asyncrl", "serve", "--model", str(model), "--port", str(port)],
        stdout=subprocess.PIPE,
        stderr=log.open("ab"),
    )
    assert proc.stdout is not None
    assert "listening on" in proc.stdout.readline().decode(), log.read_text()
    return proc


@pytest.fixture
def own_server(random_model: Path, tmp_path: Path) -> Iterator[tuple[str, list]]:  # type: ignore[type-arg]
    """A server on a fixed port, so that a restart comes back at the same URL; the list holds
    its current process (tests replace it)."""
    port = free_port()
    procs = [serve(random_model, port, tmp_path / "serve.log")]
    try:
        yield f"http://127.0.0.1:{port}", procs
    finally:
        procs[-1].terminate()
        procs[-1].wait(30)


def test_publisher_switches_adapters_and_a_restarted_server_gets_the_next(
    own_server: tuple[str, list],  # type: ignore[type-arg]
    random_model: Path,
    redis_client: redis.Redis,
    tmp_path: Path,
) -> None:
    url, procs = own_server
    keys = Keys("sglang-lora")
    weights = SglangWeightsConfig.model_validate(
        {"transport": "store", "sync_timeout_s": 20, "store_dir": str(tmp_path / "w")}
    )
    engine_cfg = SglangEngineConfig.model_validate({"urls": [url], "backoff_s": 0.05})
    engine = SglangEngine.from_config(engine_cfg, model_path="unused", lora=LORA)
    subscriber = SglangSubscriber(weights, redis_client, keys, "w0", [url])
    publisher = SglangPublisher(weights, redis_client, keys, torch.device("cpu"), lora=LORA)
    prompts = PROMPTS[:4]
    try:
        base = engine.generate(prompts, PARAMS)  # version 0: the base, no adapter named
        assert all((g.versions == 0).all() for g in base)
        check_exact(base, load_model(random_model), prompts)
        for version in (1, 2):
            model = lora_model(random_model, seed=version)
            publisher.publish(synced(model), version)
            assert subscriber.wait_for_version(version, timeout_s=30) == version
            wait_until(lambda v=version: engine.version == v, 10, "engine sees the version")
            gens = engine.generate(prompts, PARAMS)
            assert all((g.versions == version).all() for g in gens)
            check_exact(gens, model, prompts)
        assert (tmp_path / "w" / "sglang" / f"v{2:012d}" / "adapter_config.json").is_file()
        # The switch unloaded the previous adapter.
        with pytest.raises(RequestFailure, match="does not exist"):
            post(url, "/unload_lora_adapter", {"lora_name": "asyncrl-v1"})

        # Killed and restarted (same URL, base weights, version 0): the next version reaches it
        # whole, as full weights do; unloading its predecessor there fails quietly.
        procs[-1].kill()
        procs[-1].wait(30)
        procs.append(serve(random_model, int(url.rsplit(":", 1)[1]), tmp_path / "serve.log"))
        wait_until(lambda: engine.version == 0, 30, "engine sees the restarted server")
        model = lora_model(random_model, seed=3)
        publisher.publish(synced(model), 3)
        assert subscriber.wait_for_version(3, timeout_s=30) == 3
        wait_until(lambda: engine.version == 3, 10, "engine sees version 3")
        gens = engine.generate(prompts, PARAMS)
        assert all((g.versions == 3).all() for g in gens)
        check_exact(gens, model, prompts)
        assert publisher.stats().failed == 0
    finally:
        publisher.close()
        subscriber.close()
        engine.close()


def test_launch_flags_and_config() -> None:
    assert lora_flags(None) == []
    assert lora_flags(LORA) == [
        "--enable-lora",
        "--max-lora-rank", "4",
        "--lora-target-modules", "q_proj", "v_proj", "down_proj",
        "--max-loras-per-batch", "2",
        "--max-loaded-loras", "2",
    ]  # fmt: skip
    everything = LoraConfig(target_modules="all-linear")
    assert lora_flags(everything)[3:5] == ["--lora-target-modules", "all"]


def test_a_lora_run_on_sglang_servers_is_exact_at_lag_0(
    served: str, tmp_path: Path, role_config: RoleConfig
) -> None:
    """The SGLang run of `test_sglang_e2e` with `model.lora`: with max_staleness 0 each group
    trained at version v was generated by adapter v alone, and its log-probs are the trainer's."""
    lora = {"rank": 4, "alpha": 8, "target_modules": "all-linear"}
    settings = {"model.lora": lora, "weights.transport": "store", "trainer.lr": 5e-3}
    run_sglang(served, tmp_path, role_config, settings, max_diff=1e-5)
