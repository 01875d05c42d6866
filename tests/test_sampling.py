import math
import subprocess
import sys
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from pydantic import ValidationError

from asyncrl.engines.sampling import SamplingParams, sampling_logprobs


def _logits(probs: list[float]) -> torch.Tensor:
    return torch.tensor(probs).log()


def _kept(logp: torch.Tensor) -> list[int]:
    return torch.isfinite(logp).nonzero()[:, -1].tolist()


def test_defaults_are_plain_temperature_softmax() -> None:
    logits = torch.randn(3, 5, 11, generator=torch.Generator().manual_seed(0))
    out = sampling_logprobs(logits, SamplingParams(temperature=0.7))
    assert out.dtype == torch.float32
    assert torch.equal(out, torch.log_softmax(logits / 0.7, dim=-1))


def test_temperature_zero_is_greedy() -> None:
    logits = torch.tensor([[0.1, 2.0, -1.0], [3.0, 0.0, 2.9]])
    out = sampling_logprobs(logits, SamplingParams(temperature=0.0))
    assert out[0].tolist() == [-math.inf, 0.0, -math.inf]
    assert out[1].tolist() == [0.0, -math.inf, -math.inf]


def test_top_k_keeps_k_and_renormalises() -> None:
    logits = torch.randn(4, 20, generator=torch.Generator().manual_seed(1))
    out = sampling_logprobs(logits, SamplingParams(top_k=5))
    for row, lp in zip(logits, out, strict=True):
        assert sorted(_kept(lp)) == sorted(row.topk(5).indices.tolist())
        assert torch.logsumexp(lp, -1).item() == pytest.approx(0.0, abs=1e-6)


@pytest.mark.parametrize(("top_p", "kept"), [(0.1, [0]), (0.75, [0, 1]), (0.85, [0, 1, 2])])
def test_top_p_keeps_smallest_prefix_reaching_p(top_p: float, kept: list[int]) -> None:
    # Shuffled order checks that the mask is mapped back to vocabulary positions.
    probs = [0.15, 0.5, 0.05, 0.3]
    out = sampling_logprobs(_logits(probs), SamplingParams(top_p=top_p))
    by_rank = [1, 3, 0, 2]
    assert sorted(_kept(out)) == sorted(by_rank[i] for i in kept)
    expected = torch.tensor([probs[by_rank[i]] for i in kept])
    assert out[[by_rank[i] for i in kept]].exp() == pytest.approx(expected / expected.sum())


def test_top_k_applies_before_top_p() -> None:
    # After top-k=3 the masses are 0.526, 0.316, 0.158: the third starts at 0.842 >= 0.83 and
    # is cut; top-p on the untruncated distribution would have kept it (it starts at 0.8).
    out = sampling_logprobs(_logits([0.5, 0.3, 0.15, 0.05]), SamplingParams(top_k=3, top_p=0.83))
    assert _kept(out) == [0, 1]


def test_rows_are_processed_independently() -> None:
    logits = torch.randn(6, 30, generator=torch.Generator().manual_seed(2))
    params = SamplingParams(temperature=0.9, top_k=7, top_p=0.8)
    batched = sampling_logprobs(logits.view(2, 3, 30), params).view(6, 30)
    for row in range(6):
        assert torch.equal(batched[row], sampling_logprobs(logits[row], params))


@pytest.mark.parametrize(
    "bad",
    [{"temperature": -0.1}, {"top_p": 0.0}, {"top_p": 1.5}, {"top_k": -1}, {"max_new_tokens": 0}],
)
def test_invalid_params_are_rejected(bad: dict[str, float]) -> None:
    with pytest.raises(ValidationError, match=next(iter(bad))):
        SamplingParams(**bad)  # type: ignore[arg-type]


def test_unknown_field_is_rejected() -> None:
    with pytest.raises(ValidationError, match="top_q"):
        SamplingParams.model_validate({"top_q": 0.5})


def test_configs_and_seams_import_without_torch() -> None:
    code = (
        "import sys, asyncrl.config, asyncrl.engines.base, asyncrl.tasks.base, asyncrl.weights; "
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize(
    "params",
    [SamplingParams(), SamplingParams(temperature=0.7, top_k=5, top_p=0.9)],
    ids=["plain", "truncated"],
)
@pytest.mark.parametrize("chunk", [7 * 30, 2 * 16 * 30, 2**22], ids=["spans", "rows", "whole"])
def test_sequence_logprobs_in_pieces_are_the_whole_tensor_s_bit_for_bit(
    params: SamplingParams, chunk: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The trainer's log-probs, computed piece by piece (spans of 7 positions of one row, two
    whole rows, everything), and their gradients equal autograd's over the whole [B, L, V]
    tensor."""
    import asyncrl.engines.sampling as sampling

    monkeypatch.setattr(sampling, "CHUNK_ELEMENTS", chunk)
    torch.manual_seed(0)
    head = torch.nn.Linear(8, 30)
    ids = torch.randint(0, 30, (3, 17))

    class Model(torch.nn.Module):
        def forward(self, input_ids: torch.Tensor) -> Any:
            hidden = torch.sin(input_ids.unsqueeze(-1) * torch.arange(1.0, 9.0))
            return SimpleNamespace(logits=head(hidden) * 3)

    weights = torch.randn(3, 16)
    results = []
    for fn in (sampling.sequence_logprobs, _whole_tensor_logprobs):
        head.zero_grad()
        logp = fn(Model(), ids, params)
        torch.where(torch.isfinite(logp), logp * weights, 0.0).sum().backward()
        results.append((logp.detach(), head.weight.grad.clone()))
    (ours, our_grad), (whole, whole_grad) = results
    assert torch.equal(ours, whole)
    assert torch.isinf(ours).any() == (params.top_k > 0)  # truncation filtered some targets
    assert torch.equal(our_grad, whole_grad) and our_grad.abs().sum() > 0


def _whole_tensor_logprobs(
    model: torch.nn.Module, input_ids: torch.Tensor, params: SamplingParams
) -> torch.Tensor:
    logp = sampling_logprobs(model(input_ids=input_ids).logits[:, :-1], params)
    return logp.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)
