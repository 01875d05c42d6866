"""The output head in chunks of tokens (`engines.head`, `trainer.logits_chunk_tokens`): the same
log-probs and gradients as the whole logits, on a real Qwen2 model, tied and untied."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from asyncrl.engines.head import chunked_logprobs, head_logprobs
from asyncrl.engines.sampling import SamplingParams


def _qwen2(*, tied: bool, pad: int | None = None) -> Any:
    from transformers import AutoModelForCausalLM, Qwen2Config

    config = Qwen2Config(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=tied,
        pad_token_id=pad,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    return model


def _logprobs_and_grads(
    model: Any, ids: torch.Tensor, params: SamplingParams, chunk: int
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    logp = head_logprobs(model, ids, params, chunk)
    weights = torch.linspace(-1.0, 2.0, logp.numel()).view_as(logp)
    torch.where(torch.isfinite(logp), logp * weights, 0.0).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return logp.detach(), grads


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize(
    "params",
    [SamplingParams(), SamplingParams(temperature=0.7, top_k=60, top_p=0.9)],
    ids=["plain", "truncated"],
)
@pytest.mark.parametrize("chunk", [1, 7, 1000], ids=["one-token", "seven", "whole"])
def test_the_chunked_head_gives_the_whole_logits_values_and_gradients(
    tied: bool, params: SamplingParams, chunk: int
) -> None:
    # Token 3 is the padding row when tied: the lookup gives it no gradient, as nn.Embedding.
    model = _qwen2(tied=tied, pad=3 if tied else None)
    ids = torch.randint(0, 97, (3, 11), generator=torch.Generator().manual_seed(1))
    ids[0, -4:] = 3
    whole, whole_grads = _logprobs_and_grads(model, ids, params, 0)
    ours, our_grads = _logprobs_and_grads(model, ids, params, chunk)
    assert torch.equal(torch.isfinite(ours), torch.isfinite(whole))
    assert torch.isinf(ours).any() == (params.top_k > 0)  # truncation filtered some targets
    finite = torch.isfinite(whole)
    torch.testing.assert_close(ours[finite], whole[finite], rtol=1e-5, atol=1e-5)
    assert our_grads.keys() == whole_grads.keys()
    for name, grad in whole_grads.items():
        torch.testing.assert_close(our_grads[name], grad, rtol=1e-5, atol=1e-6, msg=name)
    # The tied weight's one gradient holds the head's share and the lookup's (whole_grads has
    # autograd's sum of the two).
    assert our_grads["model.embed_tokens.weight"].abs().sum() > 0
    # The model is whole again: its modules' own forwards are back.
    assert "forward" not in model.lm_head.__dict__
    assert "forward" not in model.model.embed_tokens.__dict__


def test_a_head_the_chunks_cannot_reproduce_takes_the_whole_logits() -> None:
    """A model that changes its logits after the head (here: soft-capping) still gets its own
    log-probs: the chunked attempt notices and computes them whole."""
    model = _qwen2(tied=False)
    forward = type(model).forward

    def capped(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = forward(self, *args, **kwargs)
        out.logits = torch.tanh(out.logits / 30.0) * 30.0
        return out

    ids = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(2))
    model.forward = capped.__get__(model)
    whole, _ = _logprobs_and_grads(model, ids, SamplingParams(), 0)
    with pytest.warns(UserWarning, match="trainer.logits_chunk_tokens"):
        ours, _ = _logprobs_and_grads(model, ids, SamplingParams(), 4)
    assert torch.equal(ours, whole)


@pytest.mark.parametrize(
    "targets", [["q_proj", "v_proj"], ["q_proj", "lm_head"]], ids=["layers", "head-too"]
)
def test_a_lora_adapter_trains_alike_through_the_chunked_head(targets: list[str]) -> None:
    """LoRA leaves the head frozen (chunked, no weight gradient) or wraps it (a LoRA head is not
    a plain Linear: whole logits); the adapter's gradients equal the whole logits' either way."""
    pytest.importorskip("peft")
    from asyncrl import lora
    from asyncrl.model_config import LoraConfig

    model = lora.wrap(_qwen2(tied=True), LoraConfig(target_modules=targets))
    for name, p in model.named_parameters():
        if "lora_B" in name:  # peft starts B at 0: the A gradients would be 0 on both sides
            torch.nn.init.normal_(p, std=0.1)
    ids = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():  # which path the comparison below exercises
        taken = chunked_logprobs(model, ids, SamplingParams(), 4)
    assert (taken is None) == ("lm_head" in targets)
    whole, whole_grads = _logprobs_and_grads(model, ids, SamplingParams(), 0)
    ours, our_grads = _logprobs_and_grads(model, ids, SamplingParams(), 4)
    torch.testing.assert_close(ours, whole, rtol=1e-5, atol=1e-5)
    assert our_grads.keys() == whole_grads.keys()
    assert any("lm_head" in n for n in our_grads) == ("lm_head" in targets)
    for name, grad in whole_grads.items():
        assert "lora_" in name  # the base, tied embedding included, stays frozen
        torch.testing.assert_close(our_grads[name], grad, rtol=1e-5, atol=1e-6, msg=name)
