"""LoRA on peft (`model.lora`): the adapter the trainer trains, the one an engine applies, and
what both sync.

One naming on both sides: the trainer and the builtin engine wrap the same base in the same
`peft.LoraConfig`, so an adapter tensor carries the same name (peft's, with the adapter name
`default`) in the trainer, in a weight-sync bucket or store file and in the engine, and the
transports stay generic. Weight sync carries `synced(model)`: the parameters training changes —
every one of a full fine-tune, the adapter (and `trainable_modules`) of a LoRA run.

The engine keeps the adapter unmerged (peft's LoRA layers compute x W + s · (x A) B): a new
version is a copy into the small A and B tensors, and its log-probs are those of the trainer's
forward, operation for operation. Merging it into W before each decode run was measured
(`tools/bench_lora_engine.py`).

peft is imported inside the functions: a run without `model.lora` never loads it.
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from asyncrl.config import Config
    from asyncrl.model_config import LoraConfig

ADAPTER_CONFIG = "adapter_config.json"
"""peft's file in an adapter directory: a LoRA checkpoint holds it instead of `config.json`."""


def peft_config(cfg: LoraConfig) -> Any:
    try:
        from peft import LoraConfig as PeftLoraConfig
    except ImportError as exc:  # the optional extra
        raise SystemExit("model.lora needs peft: pip install 'asyncrl[lora]'") from exc
    return PeftLoraConfig(
        r=cfg.rank,
        lora_alpha=cfg.alpha,
        lora_dropout=cfg.dropout,
        target_modules=cfg.target_modules,
        modules_to_save=cfg.trainable_modules or None,
        task_type="CAUSAL_LM",
    )


def wrap(model: torch.nn.Module, cfg: LoraConfig, adapter_dir: Path | None = None) -> Any:
    """`model` (frozen) with an adapter: a fresh one (B = 0, so the base's outputs), or the one
    saved in `adapter_dir` (a checkpoint), trainable either way."""
    config = peft_config(cfg)
    from peft import PeftModel, get_peft_model

    if adapter_dir is None:
        return get_peft_model(model, config)
    return PeftModel.from_pretrained(model, adapter_dir, is_trainable=True)


_ADAPTER_TENSOR = re.compile(r"(.+)\.(lora_[AB])\.default\.weight")
"""An adapter tensor as it is named in a peft model (and in weight syncs): adapter `default`."""


def write_adapter(out: Path, tensors: Mapping[str, torch.Tensor], cfg: LoraConfig) -> None:
    """`tensors` (the synced adapter, peft's in-model names) as the peft directory `out` that
    `save_pretrained` would write: adapter name dropped from the tensor names, and
    `target_modules` the module names that carry a pair — so `all-linear` is written resolved,
    as servers that check it against their own target list (SGLang) need."""
    from safetensors.torch import save_file

    saved: dict[str, torch.Tensor] = {}
    targets: set[str] = set()
    for name, tensor in tensors.items():
        match = _ADAPTER_TENSOR.fullmatch(name)
        if match is None:
            raise ValueError(f"{name} is not a LoRA adapter tensor (trainable_modules?)")
        saved[f"{match[1]}.{match[2]}.weight"] = tensor.contiguous()
        targets.add(match[1].rsplit(".", 1)[-1])
    config = peft_config(cfg)
    config.target_modules = sorted(targets)
    config.save_pretrained(str(out))
    save_file(saved, out / "adapter_model.safetensors", metadata={"format": "pt"})


def resume_mismatch(cfg: Config) -> str | None:
    """Why the run cannot resume its newest checkpoint with its `model.lora` (see
    `checkpoint_mismatch`), or None; launch asks before anything starts."""
    from asyncrl.trainer.checkpoint import list_checkpoints

    if cfg.model.lora is None or not cfg.trainer.resume:
        return None
    ckpts = list_checkpoints(cfg.run.path / "checkpoints")
    if not ckpts or not is_adapter_dir(ckpts[-1]):
        return None  # a full model there is refused when the trainer loads it
    return checkpoint_mismatch(cfg.model.lora, ckpts[-1], Path(cfg.model.path))


def checkpoint_mismatch(cfg: LoraConfig, checkpoint: Path, base: Path) -> str | None:
    """The fields of `model.lora` that differ from the adapter saved in `checkpoint` (a resumed
    run must train the adapter it saved: another rank or other targets fail at the first
    sync with a shape error), as one line; None when they agree. peft saves `all-linear`
    resolved to module names, so it is compared with what it resolves to on `base`."""
    saved = json.loads((checkpoint / ADAPTER_CONFIG).read_text())
    differ = []
    if saved.get("r") != cfg.rank:
        differ.append(f"rank {cfg.rank} (checkpoint: {saved.get('r')})")
    if saved.get("lora_alpha") != cfg.alpha:
        differ.append(f"alpha {cfg.alpha} (checkpoint: {saved.get('lora_alpha')})")
    held = saved.get("target_modules")
    if cfg.target_modules == "all-linear":
        same = held == "all-linear" or (isinstance(held, list) and _all_linear(base, held))
    else:
        same = isinstance(held, list) and {m.rsplit(".", 1)[-1] for m in held} == set(
            cfg.target_modules
        )
    if not same:
        differ.append(f"target_modules {cfg.target_modules} (checkpoint: {held})")
    held_save = sorted(saved.get("modules_to_save") or [])
    if held_save != sorted(cfg.trainable_modules):
        differ.append(f"trainable_modules {cfg.trainable_modules} (checkpoint: {held_save})")
    if not differ:
        return None
    return (
        f"model.lora differs from the adapter in checkpoint {checkpoint}: {'; '.join(differ)}; "
        "resume with the run's own model.lora or start a new run.dir"
    )


def _all_linear(base: Path, held: list[str]) -> bool:
    """Whether `held` (resolved module names) is what `all-linear` picks on the model at
    `base`: every linear layer but the output head, found on a weightless (meta) copy."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(base)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    head = model.get_output_embeddings()
    linear = {
        name.rsplit(".", 1)[-1]
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear) and module is not head
    }
    return {m.rsplit(".", 1)[-1] for m in held} == linear


def is_adapter_dir(path: Path) -> bool:
    return (path / ADAPTER_CONFIG).is_file()


def base_of(adapter_dir: Path) -> Path:
    """The base model directory an adapter was trained on (peft records it)."""
    return Path(json.loads((adapter_dir / ADAPTER_CONFIG).read_text())["base_model_name_or_path"])


def synced(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """(name, parameter) of what a weight update carries: the parameters that train."""
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


@contextlib.contextmanager
def adapter_disabled(model: torch.nn.Module) -> Iterator[None]:
    """The base policy of a LoRA model (the KL reference, without a second copy); a plain model
    is left as it is (its reference is a model of its own)."""
    disable = getattr(model, "disable_adapter", None)
    if disable is None:
        yield
        return
    with disable():
        yield
