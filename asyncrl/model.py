"""Which model a run trains, and building the offline quickstart model when it is absent."""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Literal

from pydantic import Field

from asyncrl.configbase import Section

if TYPE_CHECKING:
    from asyncrl.config import Config


class LoraConfig(Section):
    """Train a LoRA adapter (peft) instead of every weight: the base stays frozen, checkpoints and
    weight syncs carry the adapter only, and the KL reference is the base with the adapter
    disabled (`asyncrl.lora`)."""

    rank: int = Field(default=8, gt=0)
    """Rank r of each adapter pair (A: r × in, B: out × r)."""
    alpha: int = Field(default=16, gt=0)
    """Scale numerator: the adapter adds (alpha / rank) · B A to each target weight."""
    dropout: float = Field(default=0.0, ge=0, lt=1)
    """Dropout on the adapter's input while training (none in rollouts)."""
    target_modules: Literal["all-linear"] | Annotated[list[str], Field(min_length=1)] = Field(
        default_factory=lambda: [
            "q_proj",
            "k_proj",
            "v_proj",
            "o_proj",
            "gate_proj",
            "up_proj",
            "down_proj",
        ]
    )
    """Module names (suffixes, as peft matches them) that get an adapter, or `all-linear`: every
    linear layer but the output head."""
    trainable_modules: list[str] = Field(default_factory=list)
    """Modules trained in full beside the adapter (peft's `modules_to_save`, e.g. `lm_head`);
    they are checkpointed and synced whole."""


class ModelConfig(Section):
    path: str = "runs/models/tiny-add"
    """Local Hugging Face model directory (config.json, safetensors, tokenizer). The trainer
    starts from it and rollout engines load it; no hub downloads."""
    build_tiny: bool = False
    """Build the offline tiny quickstart model (Qwen2 architecture, warmed on the arithmetic
    task) at `path` if it is absent. Needs `task.type: arithmetic` or `agentic`."""
    tiny_moe: bool = False
    """With `build_tiny`: build the tiny model as a Qwen3-MoE (8 experts, top-2) instead of a
    Qwen2, warmed up the same way."""
    lora: LoraConfig | None = None
    """Set: train a LoRA adapter on the frozen base at `path` (needs the `lora` extra: peft)."""


def is_complete(path: Path) -> bool:
    return (path / "config.json").is_file() and any(path.glob("*.safetensors"))


def missing_model(cfg: Config) -> str | None:
    """Why `model.path` cannot serve this run (one line naming the key), or None when it holds a
    model or `model.build_tiny` will make one. Launch checks it before it touches Redis."""
    path = Path(cfg.model.path)
    if cfg.model.build_tiny or is_complete(path):
        return None
    return f"model.path={path} holds no Hugging Face model (config.json + weights)"


def ensure_model(cfg: Config, *, wait_s: float = 0.0) -> Path:
    """The model directory, built first when configured to; a rollout worker passes `wait_s` to
    wait for a trainer that is building it instead of building it twice."""
    path = Path(cfg.model.path)
    deadline = time.monotonic() + wait_s
    while not is_complete(path) and time.monotonic() < deadline:
        time.sleep(1.0)
    if is_complete(path):
        return path
    if (problem := missing_model(cfg)) is not None:
        raise SystemExit(problem)
    from asyncrl.tiny_model import build_tiny_model

    digits = getattr(cfg.task, "digits", 2)
    build_tiny_model(path, digits=digits, seed=cfg.run.seed, moe=cfg.model.tiny_moe)
    return path


def max_positions(path: Path) -> int | None:
    """Positions the model at `path` was built for (`max_position_embeddings`): no sequence
    runs, nor trains, past them (`protocol.Limits`); None where its config names none."""
    from transformers import AutoConfig

    limit = getattr(
        AutoConfig.from_pretrained(path).get_text_config(), "max_position_embeddings", None
    )
    return None if limit is None else int(limit)


def vocab_size(path: Path) -> int:
    """Token ids the model at `path` can embed are those below this: an id at or past it would
    index past the embedding (and the logits), so readers reject it (`protocol.Limits`)."""
    from transformers import AutoConfig

    return int(AutoConfig.from_pretrained(path).get_text_config().vocab_size)
