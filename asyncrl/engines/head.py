"""The output head in chunks of tokens (`trainer.logits_chunk_tokens`): the log-probs of the taken
tokens without a [tokens × vocabulary] logits tensor.

With a 152 k vocabulary the logits of a micro-batch are the largest tensors of a step (16 k tokens
× 152 k × 4 B = 10 GB): the model's output, kept for backward, then their gradient. Here the
head's forward runs on the final hidden states a chunk of tokens at a time, keeps only those
states, and backward recomputes each chunk's logits (one more head matmul: the price) and adds
its share into the hidden states' and the head weight's gradients. At most one chunk's logits
and their temporaries exist at once, in forward and backward.

A tied embedding (the head's weight is the lookup's) gets one vocabulary × hidden gradient, not
two: autograd would sum the head's and the lookup's, each a full tensor, at the end of backward.
The head hands its gradient to the lookup's backward (which always runs after it: the lookup feeds
everything), which adds its rows into it and returns it as the weight's only gradient.

Both pieces replace the modules' `forward` for one call of the model, so the model's own forward
(and FSDP's hooks around the root, which gather the head and the embedding) run as usual. They
apply to a plain `nn.Linear` head and `nn.Embedding` lookup; a model that transforms its logits
after the head (soft-capping) is detected and computed with whole logits.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import torch
import torch.nn.functional as F

from asyncrl.engines.sampling import SamplingParams, sampling_logprobs, sequence_logprobs


class _Slot:
    """The head's weight gradient on its way to the tied lookup's backward."""

    grad: torch.Tensor | None = None


def head_logprobs(
    model: torch.nn.Module, input_ids: torch.Tensor, params: SamplingParams, chunk_tokens: int
) -> torch.Tensor:
    """`sampling.sequence_logprobs`, through the head in chunks of `chunk_tokens` where that
    applies (0: whole logits)."""
    if chunk_tokens > 0 and params.temperature != 0.0:
        chunked = chunked_logprobs(model, input_ids, params, chunk_tokens)
        if chunked is not None:
            return chunked
    return sequence_logprobs(model, input_ids, params)


def chunked_logprobs(
    model: torch.nn.Module, input_ids: torch.Tensor, params: SamplingParams, chunk_tokens: int
) -> torch.Tensor | None:
    """Log-prob of each next token under the sampling distribution, [B, L-1], through the head in
    chunks of `chunk_tokens`; None where the model's head is not one this path computes (the
    caller then takes the whole logits)."""
    head, lookup = model.get_output_embeddings(), model.get_input_embeddings()  # type: ignore[operator]
    if type(head) is not torch.nn.Linear:
        return None  # a LoRA-wrapped or custom head computes more than x Wᵀ + b
    slot = _Slot() if _tied_lookup(head, lookup) else None
    produced: list[torch.Tensor] = []

    def head_forward(hidden: torch.Tensor) -> torch.Tensor:
        out = _ChunkedHead.apply(
            hidden, head.weight, head.bias, input_ids, params, chunk_tokens, slot
        )
        produced.append(out)
        return out

    def lookup_forward(ids: torch.Tensor) -> torch.Tensor:
        return _TiedLookup.apply(lookup.weight, ids, lookup.padding_idx, slot)

    with ExitStack() as swaps:
        swaps.enter_context(_forward_replaced(head, head_forward))
        if slot is not None:
            swaps.enter_context(_forward_replaced(lookup, lookup_forward))
        logits = model(input_ids=input_ids).logits
    if produced and logits is produced[0]:
        return logits
    warnings.warn(
        "trainer.logits_chunk_tokens: this model changes its logits after the head; "
        "computing them whole (set it to 0 to skip the chunked attempt)",
        stacklevel=2,
    )
    return None


def _tied_lookup(head: torch.nn.Linear, lookup: Any) -> bool:
    """Whether the lookup shares the head's trained weight and is a plain gather (no max-norm
    renormalisation, no frequency scaling, dense gradient) that `_TiedLookup` reproduces."""
    return (
        type(lookup) is torch.nn.Embedding
        and lookup.weight is head.weight
        and head.weight.requires_grad
        and lookup.max_norm is None
        and not lookup.scale_grad_by_freq
        and not lookup.sparse
    )


@contextmanager
def _forward_replaced(module: torch.nn.Module, forward: Callable[..., Any]) -> Iterator[None]:
    saved = module.__dict__.get("forward")
    module.forward = forward
    try:
        yield
    finally:
        if saved is None:
            del module.forward
        else:
            module.forward = saved


class _ChunkedHead(torch.autograd.Function):
    """`sampling_logprobs(hidden[:, :-1] Wᵀ + b).gather(next tokens)`, a chunk of tokens at a
    time; backward recomputes each chunk's logits. Each token's log-softmax is a function of its
    own logits alone, so chunking changes only the summation order of the weight's gradient."""

    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        input_ids: torch.Tensor,
        params: SamplingParams,
        chunk: int,
        slot: _Slot | None,
    ) -> torch.Tensor:
        batch, length, _ = hidden.shape
        states, targets = _flat(hidden, input_ids)
        out = torch.empty(len(states), dtype=torch.float32, device=hidden.device)
        for s in range(0, len(states), chunk):
            logp = sampling_logprobs(F.linear(states[s : s + chunk], weight, bias), params)
            out[s : s + chunk] = logp.gather(-1, targets[s : s + chunk]).squeeze(-1)
        ctx.save_for_backward(hidden, weight, bias, input_ids)
        ctx.params, ctx.chunk, ctx.slot = params, chunk, slot
        return out.view(batch, length - 1)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        hidden, weight, bias, input_ids = ctx.saved_tensors
        states, targets = _flat(hidden, input_ids)
        wants_weight, wants_bias = ctx.needs_input_grad[1], ctx.needs_input_grad[2]
        grad_states = torch.empty_like(states)
        grad_weight = torch.zeros_like(weight) if wants_weight else None
        grad_bias = torch.zeros_like(bias) if wants_bias else None
        grad_flat = grad_out.reshape(-1)
        for s in range(0, len(states), ctx.chunk):
            part = states[s : s + ctx.chunk]
            logits = F.linear(part, weight, bias).detach().requires_grad_()
            with torch.enable_grad():  # backward runs without it
                logp = sampling_logprobs(logits, ctx.params).gather(-1, targets[s : s + ctx.chunk])
                (grad_logits,) = torch.autograd.grad(
                    logp.squeeze(-1), logits, grad_flat[s : s + ctx.chunk]
                )
            grad_states[s : s + ctx.chunk] = grad_logits @ weight
            if grad_weight is not None:
                grad_weight.addmm_(grad_logits.t(), part)
            if grad_bias is not None:
                grad_bias += grad_logits.sum(0)
            del logits, logp, grad_logits
        grad_hidden = torch.zeros_like(hidden)  # the last position predicts nothing
        grad_hidden[:, :-1] = grad_states.view(hidden.shape[0], -1, hidden.shape[2])
        if ctx.slot is not None:
            ctx.slot.grad, grad_weight = grad_weight, None
        return grad_hidden, grad_weight, grad_bias, None, None, None, None


def _flat(hidden: torch.Tensor, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Hidden states of the positions that predict a token, [B·(L-1), H], and those tokens."""
    states = hidden[:, :-1].reshape(-1, hidden.shape[-1])
    return states, input_ids[:, 1:].reshape(-1, 1)


class _TiedLookup(torch.autograd.Function):
    """`F.embedding(ids, weight)` whose backward adds its rows into the head's gradient (in the
    slot) instead of making a second vocabulary × hidden tensor for autograd to sum."""

    @staticmethod
    def forward(
        ctx: Any,
        weight: torch.Tensor,
        ids: torch.Tensor,
        padding_idx: int | None,
        slot: _Slot,
    ) -> torch.Tensor:
        ctx.save_for_backward(ids)
        ctx.shape, ctx.padding_idx, ctx.slot = weight.shape, padding_idx, slot
        return F.embedding(ids, weight, padding_idx)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        (ids,) = ctx.saved_tensors
        grad, ctx.slot.grad = ctx.slot.grad, None
        if grad is None:  # the head's backward did not run (its output took no gradient)
            grad = grad_out.new_zeros(ctx.shape)
        rows, values = ids.reshape(-1), grad_out.reshape(-1, ctx.shape[1])
        if ctx.padding_idx is not None:  # nn.Embedding gives its padding row no gradient
            keep = rows != ctx.padding_idx
            rows, values = rows[keep], values[keep]
        grad.index_add_(0, rows, values.to(grad.dtype))
        return grad, None, None, None
