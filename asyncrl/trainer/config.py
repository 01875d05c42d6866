"""Configuration of the trainer role: optimisation, batching, checkpoints, evaluation."""

from __future__ import annotations

import math
from typing import Annotated, Literal

from pydantic import Field

from asyncrl.configbase import Section


class TrainerConfig(Section):
    max_steps: int = Field(default=200, ge=1)
    """Optimizer steps to run; the trainer stops (after a final checkpoint) when reached."""
    groups_per_step: int = Field(default=16, ge=1)
    """Prompt groups (each of `rollout.n` samples) consumed per optimizer step, over all ranks."""
    lr: float = Field(default=1e-3, gt=0, le=1)
    """AdamW learning rate. AdamW moves each weight by about `lr` a step, so above 1 it would
    wreck the model rather than train it (and past float32's range torch refuses the step)."""
    lr_decay: Literal["none", "linear", "cosine"] = "none"
    """Learning-rate decay from `lr` at step 0 to `lr × lr_min_ratio` at `max_steps`."""
    lr_min_ratio: float = Field(default=0.1, ge=0, le=1)
    """Final fraction of `lr` reached by the decay."""
    betas: tuple[Annotated[float, Field(ge=0, lt=1)], Annotated[float, Field(ge=0, lt=1)]] = (
        0.9,
        0.999,
    )
    """AdamW betas, each in [0, 1)."""
    weight_decay: float = Field(default=0.0, ge=0)
    """AdamW weight decay."""
    grad_clip: float = Field(default=1.0, gt=0)
    """Max global gradient norm."""
    micro_batch_tokens: int = Field(default=16384, ge=1)
    """Token budget of one micro-batch (prompt + response); packing is best-fit decreasing."""
    logits_chunk_tokens: int = Field(default=128, ge=0)
    """Tokens whose logits the output head computes at once (`engines.head`): a micro-batch's
    [tokens × vocabulary] logits never exist whole, in forward or backward, at the price of one
    more head matmul in backward (recomputing each chunk's logits); a tied embedding also gets
    one gradient tensor instead of two. 0 computes the whole logits and keeps them for backward."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass (less memory, ~30% more compute)."""
    device: Literal["auto", "cpu", "cuda", "npu"] = "auto"
    """Device of the trainer; auto picks cuda, then npu, then cpu."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Parameter dtype of the trained model."""
    parallel: Literal["ddp", "fsdp"] = "ddp"
    """Layout of the model over several trainer ranks: `ddp` keeps a whole copy (and optimizer)
    on each rank and all-reduces the gradients; `fsdp` shards parameters, gradients and optimizer
    state with FSDP2 per decoder layer, for models that do not fit one device (the reference model
    of `algo.kl_coef` too). Checkpoints and published weights hold full tensors either way. One
    rank trains unsharded whatever the value. `fsdp` needs `trainer.eval_every=0`."""
    ranks: int = Field(default=1, ge=1)
    """Trainer ranks that `launch --role all` starts (local mode and `--launcher ray`; the
    `--trainer-ranks` flag), joined by torch.distributed. A `--role trainer` process takes its
    rank and the world size from torchrun's environment (RANK, WORLD_SIZE) instead."""
    peak_flops: float | None = Field(default=None, gt=0)
    """Peak FLOP/s of one trainer device, for the estimated MFU (6 × params × tokens / time /
    (ranks × peak)); unset reports no MFU."""
    checkpoint_every: int = Field(default=10, ge=1)
    """Write a checkpoint every this many steps; trajectory entries are acked only then."""
    keep_checkpoints: int = Field(default=2, ge=1)
    """Checkpoints kept on disk (older ones are deleted after a newer one is durable)."""
    eval_every: int = Field(default=10, ge=0)
    """Evaluate on the held-out split every this many steps (0 disables)."""
    eval_size: int = Field(default=500, ge=1)
    """Held-out prompts per evaluation."""
    eval_samples: int = Field(default=1, ge=1)
    """Episodes sampled per held-out prompt; more lower the noise of the figure at temperature
    > 0 (the eval costs that many times more)."""
    eval_temperature: float = Field(default=1.0, ge=0)
    """Sampling temperature of the evaluation (0 = greedy)."""
    wait_timeout_s: float = Field(default=600.0, gt=0)
    """Give up (exit non-zero) if no trajectory arrives for this long."""
    seed: int = 0
    """Seed of the trainer's RNG and of the data cursor's shuffling."""
    resume: bool = True
    """Resume from the latest checkpoint in run.dir when there is one."""

    def lr_at(self, step: int) -> float:
        """Learning rate of the step that follows `step` completed steps (stateless, so a
        resumed run needs no scheduler state)."""
        progress = min(step / self.max_steps, 1.0)
        if self.lr_decay == "linear":
            scale = 1.0 - progress
        elif self.lr_decay == "cosine":
            scale = 0.5 * (1.0 + math.cos(math.pi * progress))
        else:
            return self.lr
        return self.lr * (self.lr_min_ratio + (1.0 - self.lr_min_ratio) * scale)
