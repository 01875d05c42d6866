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
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from asyncrl.model import LoraConfig

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
