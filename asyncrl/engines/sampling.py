"""The sampling distribution, shared by the engine (behaviour) and the trainer (recomputation).

Both sides call `sampling_logprobs` on their logits, so at policy lag 0 the behaviour log-prob
recorded during generation and the one the trainer recomputes are the same function of the same
numbers.
"""

from typing import Any

import torch

from asyncrl.engines.config import SamplingParams

__all__ = ["SamplingParams", "sampling_logprobs", "sequence_logprobs"]


def sampling_logprobs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Log-probabilities of the distribution tokens are actually drawn from.

    `logits` has shape [..., V]; the result has the same shape, float32. Steps: divide by the
    temperature; keep the top-k logits; keep the nucleus of mass top_p; log-softmax over what is
    kept. Filtered tokens get -inf. With the defaults (top_p=1, top_k=0) this is
    `log_softmax(logits / temperature)`. Temperature 0 is greedy: the argmax gets 0, the rest -inf.

    Top-k and top-p: the recorded log-prob is the one under the truncated, renormalised
    distribution (what was really sampled from), not under the plain softmax. The trainer
    applies the same processing, so importance ratios compare like with like. A token sampled
    under older weights may fall outside the newer nucleus and get -inf (ratio 0): the PPO
    formulas clamp the log-ratio, and such a token then carries no gradient.
    """
    logits = logits.float()
    if params.temperature == 0.0:
        greedy = torch.full_like(logits, float("-inf"))
        return greedy.scatter_(-1, logits.argmax(-1, keepdim=True), 0.0)
    scaled = logits / params.temperature
    if 0 < params.top_k < scaled.shape[-1]:
        kth = scaled.topk(params.top_k, dim=-1).values[..., -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if params.top_p < 1.0:
        scaled = _nucleus(scaled, params.top_p)
    return torch.log_softmax(scaled, dim=-1)


def _nucleus(scaled: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep each token whose strictly more likely tokens hold less than top_p of the mass."""
    sorted_logits, order = scaled.sort(dim=-1, descending=True)
    probs = sorted_logits.softmax(dim=-1)
    # Exclusive cumulative mass: the most likely token always survives, since its mass before is 0.
    drop_sorted = probs.cumsum(dim=-1) - probs >= top_p
    drop = torch.empty_like(drop_sorted).scatter_(-1, order, drop_sorted)
    return scaled.masked_fill(drop, float("-inf"))


def sequence_logprobs(
    model: torch.nn.Module, input_ids: torch.Tensor, params: SamplingParams
) -> torch.Tensor:
    """The trainer's forward path: one full forward of the right-padded `input_ids` [B, L]
    without an attention mask (causal attention keeps padding out of the real tokens' logits)
    and the log-prob of each next token under the sampling distribution, [B, L-1]."""
    logits = model(input_ids=input_ids).logits
    if params.temperature == 0.0:  # greedy log-probs are constants: nothing to keep for backward
        logp = sampling_logprobs(logits[:, :-1], params)
        return logp.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    out = _TakenLogprobs.apply(logits, input_ids, params)
    assert isinstance(out, torch.Tensor)
    return out


CHUNK_ELEMENTS = 2**22
"""Logits per piece of `_TakenLogprobs` (16 MiB of fp32): its temporaries are this big, not
[tokens × vocab]."""


def _pieces(batch: int, length: int, vocab: int) -> list[tuple[slice, slice]]:
    """(rows, positions) pieces of [batch, length] holding at most `CHUNK_ELEMENTS` logits
    (one position at least): whole rows together while they fit, else spans of one row."""
    per_row = length * vocab
    if per_row <= CHUNK_ELEMENTS:
        rows = CHUNK_ELEMENTS // per_row
        return [(slice(b, b + rows), slice(0, length)) for b in range(0, batch, rows)]
    span = max(1, CHUNK_ELEMENTS // vocab)
    return [
        (slice(b, b + 1), slice(p, p + span)) for b in range(batch) for p in range(0, length, span)
    ]


class _TakenLogprobs(torch.autograd.Function):
    """`sampling_logprobs(logits[:, :-1]).gather(next tokens)`, computed piece by piece.

    Autograd over the whole tensor keeps a float32 [tokens × vocab] log-softmax alive for
    backward and makes several more of that size in it (the gather's scattered gradient, the
    softmax's, the temperature's, the slice's): about 6 copies of the logits at once, most of
    a trainer's memory beyond parameters, gradients and Adam with a 152 k vocabulary. Here forward
    keeps only the logits (the model made them), and backward recomputes each piece's
    log-softmax and writes its gradient into one tensor the size of the logits. Every row's
    log-softmax is a function of that row alone, and each piece runs the same operations as the
    whole tensor did, so values and gradients are today's bit for bit."""

    @staticmethod
    def forward(
        ctx: Any, logits: torch.Tensor, input_ids: torch.Tensor, params: SamplingParams
    ) -> torch.Tensor:
        batch, length, vocab = logits.shape
        targets = input_ids[:, 1:].unsqueeze(-1)
        out = torch.empty(batch, length - 1, dtype=torch.float32, device=logits.device)
        for rows, span in _pieces(batch, length - 1, vocab):
            logp = sampling_logprobs(logits[rows, span], params)
            out[rows, span] = logp.gather(-1, targets[rows, span]).squeeze(-1)
        ctx.save_for_backward(logits, input_ids)
        ctx.params = params
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        logits, input_ids = ctx.saved_tensors
        batch, length, vocab = logits.shape
        targets = input_ids[:, 1:].unsqueeze(-1)
        grad = torch.zeros_like(logits)
        for rows, span in _pieces(batch, length - 1, vocab):
            piece = logits[rows, span].detach().requires_grad_()
            with torch.enable_grad():  # backward runs without it
                logp = sampling_logprobs(piece, ctx.params).gather(-1, targets[rows, span])
                (grad[rows, span],) = torch.autograd.grad(
                    logp.squeeze(-1), piece, grad_out[rows, span]
                )
        return grad, None, None
