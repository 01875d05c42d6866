"""Config of the model a run trains (`model:`), LoRA included. A config-only module at the bottom
of the tree: `asyncrl.config` assembles it and the engines and publishers read `LoraConfig`,
while the code that builds or inspects a model (`asyncrl.model`) builds on them."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from asyncrl.configbase import Section


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
