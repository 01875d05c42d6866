"""The sampling distribution, shared by the engine (behaviour) and the trainer (recomputation).

Both sides call `sampling_logprobs` on their logits, so at policy lag 0 the behaviour log-prob
recorded during generation and the one the trainer recomputes are the same function of the same
numbers.
"""

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
    logits = model(input_ids=input_ids).logits[:, :-1]
    logp = sampling_logprobs(logits, params)
    return logp.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)
