"""The engine seam: what a rollout worker needs from whatever generates tokens."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Protocol, assert_never

import numpy as np

from asyncrl.rollout.config import (
    EngineConfig,
    SamplingParams,
    SglangEngineConfig,
    TorchEngineConfig,
)

if TYPE_CHECKING:
    from collections.abc import Mapping

    import torch


@dataclass(frozen=True)
class Generation:
    """One response. The three arrays have one entry per generated token, stop token included."""

    token_ids: np.ndarray
    """int32 token ids of the response (the prompt is not repeated)."""

    logprobs: np.ndarray
    """float32 behaviour log-probs: each token under the distribution it was sampled from."""

    versions: np.ndarray
    """int32 policy version of the weights that produced each token's logits; non-decreasing."""

    finish: Literal["stop", "length"]
    """"stop": ended by a stop token (the last token); "length": hit max_new_tokens."""

    cached_tokens: int = 0
    """Prompt tokens whose keys came from the engine's prefix cache instead of a prefill (0 when
    the engine keeps none or does not say)."""


class RolloutEngine(Protocol):
    """Generates responses and takes new weights while it does.

    Choices:
    - Token ids in, token ids out. Tokenising and chat templates belong to the task, so the ids
      the trainer sees are exactly the ids the engine conditioned on.
    - One result per prompt; n samples of a prompt are n copies of it in the request. Engines
      batch better than they share prefixes at our sizes, and the caller keeps group bookkeeping.
    - Weights are pushed, not pulled: the weight-sync thread calls `stage_weights`, and the engine
      swaps them in between two decode steps of a running `generate` (immediately when idle).
      Running sequences keep their KV cache, so tokens after the swap are drawn from the new
      weights attending to keys computed by the old ones; each token's recorded version and
      log-prob describe exactly that draw, and the trainer's importance correction does the rest.
    """

    @property
    def version(self) -> int:
        """Policy version of the weights loaded now."""
        ...

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        """Sample one response per prompt, in the order of `prompts`."""
        ...

    def stage_weights(self, tensors: Mapping[str, torch.Tensor], version: int) -> None:
        """Hand over weights of `version` (thread-safe); the engine owns the tensors from now on.

        A newer staging replaces one not yet applied. Raises if `version` is not newer than
        the loaded or staged one, or if names or shapes do not match `state_dict_for_sync`.
        """
        ...

    def state_dict_for_sync(self) -> dict[str, torch.Tensor]:
        """The tensors a weight update must cover, by name (live views: do not modify)."""
        ...


def build_engine(cfg: EngineConfig, *, model_path: str, device: str = "cpu") -> RolloutEngine:
    """The engine `cfg.type` names, serving the Hugging Face model in the local directory
    `model_path`; heavy imports happen here."""
    match cfg:
        case TorchEngineConfig():
            from asyncrl.rollout.torch_engine import TorchEngine

            return TorchEngine.from_config(cfg, model_path=model_path, device=device)
        case SglangEngineConfig():
            # The servers hold the model and their own devices; `device` is not used.
            from asyncrl.rollout.sglang_engine import SglangEngine

            return SglangEngine.from_config(cfg, model_path=model_path)
        case _:
            assert_never(cfg)
