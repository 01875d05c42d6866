"""The engine seam: what a rollout worker (and held-out evaluation) needs from whatever generates
tokens. `RolloutEngine` is all of it; `InProcessWeights` is the extra capability of an engine
whose weights live in this process, so that only such an engine is handed tensors.

The seam only declares: the engines are members of their own modules (`torch_engine`,
`asyncrl.sglang.engine`), and the rollout role picks one (`asyncrl.rollout.backends`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Protocol, runtime_checkable

import numpy as np

from asyncrl.engines.config import SamplingParams

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

    routed_experts: np.ndarray | None = None
    """uint16 [prompt + response tokens − 1, MoE layers, top-k]: the experts each fed token was
    routed to (`rollout.capture_routing`; `protocol.Sample.routed_experts`); None: not captured."""


class EngineError(RuntimeError):
    """Generation failed for some prompts after retries; the caller dead-letters them.

    `reason` is a short stable code, an `asyncrl.reasons.EngineReason`.
    """

    def __init__(
        self,
        reason: str,
        detail: str,
        generations: list[Generation | None] | None = None,
    ) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail
        self.generations: list[Generation | None] = generations or []
        """One entry per prompt of the failed `generate` call: the result, or None where the
        prompt failed (`failed` lists those)."""

    @property
    def failed(self) -> list[int]:
        """Indices of the prompts that got no generation."""
        return [i for i, g in enumerate(self.generations) if g is None]


class RolloutEngine(Protocol):
    """Generates responses; new weights reach it while it does.

    Choices:
    - Token ids in, token ids out. Tokenising and chat templates belong to the task, so the ids
      the trainer sees are exactly the ids the engine conditioned on.
    - One result per prompt; n samples of a prompt are n copies of it in the request. Engines
      batch better than they share prefixes at our sizes, and the caller keeps group bookkeeping.
    - Weights are pushed, not pulled, and may change during a `generate`: each token's recorded
      version and log-prob describe the weights it was drawn from, and the trainer's importance
      correction does the rest. How they arrive is the engine's affair: an engine in this
      process takes them through `InProcessWeights`; one in servers of its own (SGLang) gets
      them from the trainer's publisher directly.
    """

    @property
    def version(self) -> int:
        """Policy version of the weights loaded now."""
        ...

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        """Sample one response per prompt, in the order of `prompts`."""
        ...


@runtime_checkable
class InProcessWeights(Protocol):
    """The capability of an engine whose weights live in this process: the worker's weight
    subscriber hands it each new version.

    The engine swaps staged weights in between two decode steps of a running `generate`
    (immediately when idle). Running sequences keep their KV cache, so tokens after the swap are
    drawn from the new weights attending to keys computed by the old ones.
    """

    def stage_weights(self, tensors: Mapping[str, torch.Tensor], version: int) -> None:
        """Hand over weights of `version` (thread-safe); the engine owns the tensors from now on.
        The builtin engine copies them into its own, except a `weights.base.Released` mapping's
        (a subscriber's receive buffer, never written again), which it keeps as they are.

        A newer staging replaces one not yet applied. Raises if `version` is not newer than
        the loaded or staged one, or if names or shapes do not match `state_dict_for_sync`.
        """
        ...

    def state_dict_for_sync(self) -> dict[str, torch.Tensor]:
        """The tensors a weight update must cover, by name (live views: do not modify)."""
        ...


@runtime_checkable
class Rescoring(Protocol):
    """The capability of an engine that can score finished sequences with the weights it holds
    through the trainer's forward path (`sampling.sequence_logprobs`): the mismatch audit
    (`rollout.audit_fraction`) compares that with the behaviour log-probs it recorded."""

    def rescore(
        self, sequences: list[tuple[list[int], int]], params: SamplingParams, dtype: str
    ) -> tuple[int, list[np.ndarray]]:
        """(version of the weights used, float32 log-probs of each sequence's tokens after its
        first `n_prompt`) for `(token ids, n_prompt)` pairs, computed in `dtype` parameters."""
        ...
