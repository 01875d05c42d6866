"""A rollout worker with another model than the run's is refused at join, before it takes a
prompt; the identity is the model's (names, shapes, vocabulary, LoRA shape), not a dtype's."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import redis
import torch

from asyncrl.launch.redis_server import RedisServer
from asyncrl.model_config import LoraConfig
from asyncrl.model_identity import model_identity
from asyncrl.runstate import PROMPTS_GROUP, Keys

from role_procs import (
    SMALL_RUN,
    Role,
    step_lines,
    stop_all,
    trainer_and_worker,
    wait_until,
    write_role_config,
)


def copy_model(src: Path, out: Path, *, layers: int | None = None, dtype: torch.dtype) -> Path:
    """`src` saved again in `dtype`, or a fresh model of `layers` layers on its config."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if layers is None:
        model = AutoModelForCausalLM.from_pretrained(src, dtype=dtype)
    else:
        config = AutoConfig.from_pretrained(src)
        config.num_hidden_layers = layers
        config.layer_types = config.layer_types[:layers]
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.save_pretrained(out)
    for f in src.iterdir():
        if "token" in f.name or f.name.endswith(".model"):
            shutil.copy(f, out / f.name)
    return out


def test_the_identity_is_the_models_shape_not_its_dtype(
    random_model: Path, random_moe: Path, tmp_path: Path
) -> None:
    ours = model_identity(random_model, None)
    bf16 = copy_model(random_model, tmp_path / "bf16", dtype=torch.bfloat16)
    assert model_identity(bf16, None) == ours
    one_layer = copy_model(random_model, tmp_path / "one", layers=1, dtype=torch.float32)
    assert model_identity(one_layer, None).digest != ours.digest
    assert model_identity(one_layer, None).tensors < ours.tensors
    assert model_identity(random_moe, None).digest != ours.digest
    lora = LoraConfig()
    assert model_identity(random_model, lora).digest != ours.digest
    assert model_identity(random_model, LoraConfig(alpha=32)) == model_identity(random_model, lora)
    assert model_identity(random_model, LoraConfig(rank=4)) != model_identity(random_model, lora)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_worker_with_a_one_layer_copy_is_refused_at_join_and_takes_no_prompt(
    redis_server: RedisServer, redis_client: redis.Redis, random_model: Path, tmp_path: Path
) -> None:
    keys = Keys("identity")
    config = write_role_config(tmp_path, redis_server.url, random_model, keys.run_id, SMALL_RUN)
    one_layer = copy_model(random_model, tmp_path / "one-layer", layers=1, dtype=torch.float32)
    other = tmp_path / "other"
    other.mkdir()
    other_config = write_role_config(other, redis_server.url, one_layer, keys.run_id, SMALL_RUN)
    run_dir = tmp_path / "run"
    logs = tmp_path / "logs"
    roles = trainer_and_worker(config, logs)
    try:
        wait_until(lambda: len(step_lines(run_dir)) >= 1, 300, "a first step", roles)
        stranger = Role("rollout", other_config, logs / "w1.log", "--worker-id", "w1")
        rc = stranger.wait(120)
        steps = len(step_lines(run_dir))
        wait_until(lambda: len(step_lines(run_dir)) >= steps + 2, 300, "training goes on", roles)
        consumers = redis_client.xinfo_consumers(keys.prompts, PROMPTS_GROUP)
        registered = redis_client.hkeys(keys.weights)
    finally:
        stop_all(roles)
    out = stranger.log.read_text()
    assert rc == 2, out
    assert "Traceback" not in out, out
    refused = [line for line in out.splitlines() if "is not the model run identity trains" in line]
    assert len(refused) == 1 and str(one_layer) in refused[0], out
    # It never read a prompt, nor registered for weights.
    assert [c["name"] for c in consumers] == [b"w0"], consumers
    assert b"join:w1" not in registered
