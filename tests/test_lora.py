"""LoRA (`model.lora`): the trainer's adapter reaches the builtin engine alone (store transport),
its log-probs there are the trainer's, the KL reference is the base with the adapter off,
checkpoints hold the adapter and its optimizer state only and resume exactly, and `asyncrl
export` writes a peft directory or a merged model that give the trainer's log-probs."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import redis
import torch
from safetensors import safe_open

from asyncrl.config import ConfigError, load_config
from asyncrl.engines.config import TorchEngineConfig
from asyncrl.engines.sampling import SamplingParams
from asyncrl.engines.torch_engine import TorchEngine
from asyncrl.export import export
from asyncrl.lora import (
    adapter_disabled,
    checkpoint_mismatch,
    resume_mismatch,
    synced,
    wrap,
    write_adapter,
)
from asyncrl.model_config import LoraConfig
from asyncrl.rollout.backends import build_subscriber
from asyncrl.runstate import Keys
from asyncrl.trainer.backends import build_publisher
from asyncrl.trainer.builder import build_models, build_optimizer, resume
from asyncrl.trainer.checkpoint import TrainerState, list_checkpoints, save_checkpoint
from asyncrl.trainer.parallel import full_state
from asyncrl.weights.config import StoreWeightsConfig

from engine_helpers import PROMPTS, load_model, reference_logprobs
from role_procs import asyncrl

LORA = {"rank": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj", "down_proj"]}


def lora_cfg(tmp_path: Path, model: Path, *extra: str):  # type: ignore[no-untyped-def]
    overrides = [f"run.dir={tmp_path / 'run'}", f"model.path={model}"]
    overrides += [f"model.lora.{k}={json.dumps(v)}" for k, v in LORA.items()]
    return load_config(None, [*overrides, *extra])


def trained_adapter(model: torch.nn.Module, seed: int) -> None:
    """Move every adapter tensor away from its init (B = 0 would leave the base's outputs)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in synced(model):
            p.add_(0.2 * torch.randn(p.shape, generator=g))


def logprobs(model: torch.nn.Module, prompt: list[int], response: np.ndarray) -> np.ndarray:
    model.eval()
    return reference_logprobs(model, prompt, response, SamplingParams())  # type: ignore[arg-type]


def test_config_keys_and_errors(tmp_path: Path, random_model: Path) -> None:
    cfg = lora_cfg(tmp_path, random_model)
    assert cfg.model.lora == LoraConfig(**LORA)  # type: ignore[arg-type]
    assert load_config(None, []).model.lora is None
    with pytest.raises(ConfigError, match=r"model\.lora\.rank"):
        load_config(None, ["model.lora.rank=0"])
    sglang = ["rollout.engine.type=sglang", "rollout.engine.launch=true", "weights.type=sglang"]
    with pytest.raises(ConfigError, match=r"model\.lora .* needs weights\.transport=store"):
        load_config(None, ["model.lora.rank=4", *sglang])
    with pytest.raises(ConfigError, match=r"model\.lora\.trainable_modules must be empty"):
        load_config(
            None,
            ["model.lora.trainable_modules=[lm_head]", "weights.transport=store", *sglang],
        )
    assert load_config(None, ["model.lora.rank=4", "weights.transport=store", *sglang]).model.lora


def test_trainer_trains_the_adapter_only_with_kl_on_the_base(
    tmp_path: Path, random_model: Path
) -> None:
    cfg = lora_cfg(tmp_path, random_model, "algo.kl_coef=0.1")
    model, ref, n_params = build_models(cfg, random_model, random_model, lambda m: None)
    assert ref is model  # no second copy: the reference is the base with the adapter off
    names = [n for n, _ in synced(model)]
    assert names and all(".lora_A." in n or ".lora_B." in n for n in names)
    assert {n.split(".")[-4] for n in names} == {"q_proj", "v_proj", "down_proj"}
    assert sum(p.numel() for _, p in synced(model)) < 0.2 * n_params
    optimizer = build_optimizer(cfg, model)
    assert [p for g in optimizer.param_groups for p in g["params"]] == [p for _, p in synced(model)]

    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(random_model).eval()
    trained_adapter(model, seed=1)
    ids = torch.tensor([PROMPTS[2]])
    model.eval()
    with torch.no_grad():
        adapted = model(input_ids=ids).logits
        with adapter_disabled(ref):
            reference = ref(input_ids=ids).logits
        expected = base(input_ids=ids).logits
    assert torch.equal(reference, expected)
    assert (adapted - expected).abs().max() > 1e-3


def test_adapter_alone_reaches_the_engine_and_its_logprobs_are_the_trainers(
    tmp_path: Path, random_model: Path, redis_client: redis.Redis
) -> None:
    """Lag 0 with the adapter applied in the engine: every token's log-prob is the trainer's
    (< 1e-5, fp32), stamped with the adapter's version; the store file holds the adapter only."""
    cfg = lora_cfg(tmp_path, random_model)
    assert cfg.model.lora is not None
    model, _, n_params = build_models(cfg, random_model, random_model, lambda m: None)
    engine = TorchEngine.from_config(
        TorchEngineConfig(), model_path=str(random_model), lora=cfg.model.lora
    )
    assert engine.state_dict_for_sync().keys() == dict(synced(model)).keys()
    params = SamplingParams(max_new_tokens=10)
    keys = Keys("lora")
    store = StoreWeightsConfig(store_dir=tmp_path / "weights", sync_timeout_s=5.0)
    pub = build_publisher(store, redis_client, keys, device="cpu")
    sub = build_subscriber(
        store, redis_client, keys, "w", device="cpu", on_weights=engine.stage_weights
    )
    try:
        for version in (1, 2):
            trained_adapter(model, seed=version)
            pub.publish(synced(model), version)
            assert sub.wait_for_version(version, timeout_s=30) == version
            assert engine.version == version
            with safe_open(tmp_path / "weights" / f"v{version:012d}.safetensors", "pt") as f:
                stored = set(f.keys())
            assert stored == {n for n, _ in synced(model)}
            for prompt, gen in zip(PROMPTS, engine.generate(PROMPTS, params), strict=True):
                assert (gen.versions == version).all()
                expected = logprobs(model, prompt, gen.token_ids)
                np.testing.assert_allclose(gen.logprobs, expected, rtol=0, atol=1e-5)
        synced_bytes = sum(p.numel() * p.element_size() for _, p in synced(model))
        assert synced_bytes < 0.2 * n_params * 4
    finally:
        sub.close()
        pub.close()


def test_checkpoint_holds_the_adapter_resumes_and_exports(
    tmp_path: Path, random_model: Path
) -> None:
    cfg = lora_cfg(tmp_path, random_model)
    model, _, _ = build_models(cfg, random_model, random_model, lambda m: None)
    optimizer = build_optimizer(cfg, model)
    # One real AdamW step, so that the optimizer has state to checkpoint.
    model.train()
    loss = model(input_ids=torch.tensor([PROMPTS[2]])).logits.square().mean()
    loss.backward()
    optimizer.step()
    trained_adapter(model, seed=3)
    model_state, optimizer_state = full_state(model, optimizer)
    state = TrainerState(step=7, version=7, cursor={"seed": 0}, wall_seconds=1.0)
    ckpt = save_checkpoint(
        cfg.run.path / "checkpoints",
        model,
        model_state,
        optimizer_state,
        state,
        tokenizer_dir=random_model,
        keep=2,
    )
    files = {f.name for f in ckpt.iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors", "optimizer.pt"} <= files
    assert "model.safetensors" not in files
    saved_opt = torch.load(ckpt / "optimizer.pt", weights_only=True)
    adapter_names = {n for n, _ in synced(model)}
    assert set(saved_opt["state"]) == adapter_names

    # Resume as the builder does: base from model.path, adapter and optimizer from the checkpoint.
    assert list_checkpoints(cfg.run.path / "checkpoints") == [ckpt]
    again, _, _ = build_models(cfg, ckpt, random_model, lambda m: None)
    opt2 = build_optimizer(cfg, again)
    resumed = resume(ckpt, again, opt2, rank=0)
    assert resumed.step == 7
    for (n, a), (m, b) in zip(synced(model), synced(again), strict=True):
        assert n == m and torch.equal(a, b)
    _, restored = full_state(again, opt2)
    for name in adapter_names:
        for k in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(restored["state"][name][k], optimizer_state["state"][name][k])

    # The same run without model.lora cannot resume from it (one line, before anything starts).
    with pytest.raises(SystemExit, match=r"holds a LoRA adapter, but model\.lora is unset"):
        build_models(load_config(None, []), ckpt, random_model, lambda m: None)

    # Another rank, alpha or targets cannot resume it either: one line at launch, exit 2.
    assert resume_mismatch(cfg) is None
    other = lora_cfg(tmp_path, random_model, "model.lora.rank=8", "model.lora.alpha=8")
    problem = resume_mismatch(other)
    assert problem is not None and problem.startswith("model.lora differs"), problem
    assert "rank 8 (checkpoint: 4)" in problem and "alpha" not in problem
    overrides = [f"model.lora.{k}={json.dumps(v)}" for k, v in {**LORA, "alpha": 32}.items()]
    proc = asyncrl(
        "launch",
        "--role",
        "trainer",
        f"run.dir={cfg.run.path}",
        f"model.path={random_model}",
        "model.lora.target_modules=[q_proj]",
        *overrides[:2],
    )
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("asyncrl: config error: model.lora"), lines
    assert "alpha 32 (checkpoint: 8)" in lines[0] and "target_modules ['q_proj']" in lines[0]

    prompt = PROMPTS[2]
    response = np.array([3, 4, 5, 6, 7], dtype=np.int64)
    expected = logprobs(model, prompt, response)

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    adapter_out = export(cfg.run.path, tmp_path / "adapter", merge=False)
    assert not (adapter_out / "optimizer.pt").exists()
    base = AutoModelForCausalLM.from_pretrained(random_model)
    loaded = PeftModel.from_pretrained(base, adapter_out)
    np.testing.assert_allclose(logprobs(loaded, prompt, response), expected, rtol=0, atol=1e-6)

    merged_out = export(cfg.run.path, tmp_path / "merged", merge=True)
    assert not (merged_out / "adapter_config.json").exists()
    merged = AutoModelForCausalLM.from_pretrained(merged_out)
    np.testing.assert_allclose(logprobs(merged, prompt, response), expected, rtol=0, atol=1e-5)


def test_written_adapter_loads_in_peft_with_resolved_targets(
    tmp_path: Path, random_model: Path
) -> None:
    """`write_adapter` (what SGLang servers load) gives a directory peft loads to the same
    log-probs, with `all-linear` written as the modules it resolved to — which `all-linear`
    matches again when a run resumes."""
    everything = LoraConfig(rank=4, alpha=8, target_modules="all-linear")
    model = wrap(load_model(random_model), everything)
    trained_adapter(model, seed=5)
    write_adapter(tmp_path / "a", dict(synced(model)), everything)
    saved = json.loads((tmp_path / "a" / "adapter_config.json").read_text())
    assert saved["r"] == 4 and "q_proj" in saved["target_modules"]
    assert "lm_head" not in saved["target_modules"]
    from peft import PeftModel

    loaded = PeftModel.from_pretrained(load_model(random_model), tmp_path / "a")
    response = np.array([3, 4, 5, 6, 7], dtype=np.int64)
    np.testing.assert_allclose(
        logprobs(loaded, PROMPTS[2], response),
        logprobs(model, PROMPTS[2], response),
        rtol=0,
        atol=1e-6,
    )
    assert checkpoint_mismatch(everything, tmp_path / "a", random_model) is None
    narrow = LoraConfig(rank=4, alpha=8, target_modules=["q_proj"])
    assert "target_modules" in str(checkpoint_mismatch(narrow, tmp_path / "a", random_model))
