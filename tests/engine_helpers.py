"""The torch engine tests' prompts, engine and the references they check it against."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from asyncrl.engines.config import TorchEngineConfig
from asyncrl.engines.sampling import SamplingParams, sampling_logprobs
from asyncrl.engines.torch_engine import TorchEngine
from asyncrl.rollout.backends import build_engine

# Variable lengths in one batch exercise left padding and per-row positions.
PROMPTS = [[1, 4, 5, 13], [1, 7], [1, 3, 9, 13, 8, 8, 14], [1], [1, 6, 6, 6, 6, 6, 6, 6, 6, 6]]


def make_engine(model_dir: Path, **cfg: object) -> TorchEngine:
    engine = build_engine(TorchEngineConfig(**cfg), model_path=str(model_dir))  # type: ignore[arg-type]
    assert isinstance(engine, TorchEngine)
    return engine


def load_model(model_dir: Path) -> PreTrainedModel:
    return AutoModelForCausalLM.from_pretrained(model_dir).eval()


def perturbed(model: PreTrainedModel, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        name: p.detach() + 0.05 * torch.randn(p.shape, generator=g)
        for name, p in model.named_parameters()
    }


@torch.no_grad()
def reference_logprobs(
    model: PreTrainedModel, prompt: list[int], response: np.ndarray, params: SamplingParams
) -> np.ndarray:
    """Log-probs of `response` from one unpadded full forward pass, as the trainer computes them."""
    ids = torch.tensor([prompt + response.tolist()])
    logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1]
    logp = sampling_logprobs(logits, params)
    return logp.gather(-1, torch.from_numpy(response).long()[:, None])[:, 0].numpy()
