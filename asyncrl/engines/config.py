"""Config of the rollout engines and of sampling. Nothing here imports torch: the CLI validates
configs without it.

Engines are chosen by `type` (a pydantic discriminated union, `rollout.config.EngineConfig`,
assembled where the rollout section is), so an unknown engine is reported with the allowed values
and adding one is one class plus one union member; this module declares only the builtin one.
"""

from typing import Literal

from pydantic import Field

from asyncrl.configbase import Section


class TorchEngineConfig(Section):
    """The builtin engine: a Hugging Face causal LM driven by a KV-cached sampling loop."""

    type: Literal["torch"] = "torch"
    """Engine backend."""

    device: Literal["auto", "cpu", "cuda", "npu"] = "auto"
    """Where the engine runs. `auto`: cuda where torch sees one, else cpu; an accelerator's index
    is the process' LOCAL_RANK."""

    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Dtype the weights are loaded in; logits are processed in float32 either way."""

    max_batch_size: int = Field(default=256, ge=1)
    """Most sequences decoded together; larger requests are split into micro-batches."""

    seed: int = 0
    """Seed of the engine's sampling generator (one stream over the engine's lifetime)."""

    prefix_cache_tokens: int = Field(default=0, ge=0)
    """Tokens of KV kept after each sequence ends, so that a request extending it (an episode's
    next turn) prefills only the tokens added since; least recently stored evicted first. 0: no
    cache (single-turn tasks never hit it)."""

    prefix_cache_stale: bool = False
    """Reuse cached KV computed by weights older than the loaded ones, as running sequences do
    across a weight swap. False: a swap drops every entry the new weights did not compute, so a
    token's version names the weights behind its whole context (SGLang's `retract` flushes its
    cache the same way)."""


class SamplingParams(Section):
    """How tokens are drawn. Lives here, torch-free, so that configs can embed it directly.

    Processing order, shared by the engine and the trainer (`sampling.sampling_logprobs`):
    temperature, then top-k, then top-p, then renormalisation.
    """

    temperature: float = Field(default=1.0, ge=0.0)
    """Logits are divided by it; 0 means greedy (the argmax gets log-probability 0)."""

    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    """Nucleus: keep the most likely tokens until their mass reaches top_p; 1 disables."""

    top_k: int = Field(default=0, ge=0)
    """Keep the k most likely tokens (ties at the k-th value are kept too); 0 disables."""

    max_new_tokens: int = Field(default=64, ge=1)
    """Longest response; a response cut here finishes with reason "length"."""

    stop_token_ids: tuple[int, ...] | None = None
    """Tokens that end a response (kept as its last token); None: the model's EOS ids."""
