"""Policy losses (PPO with dual clip, GSPO), loss aggregation and KL estimators.

Token tensors are ``[B, T]``: one row per response, ``mask`` 1 on response tokens that
count and 0 on padding. Losses are to be minimised. Definitions follow verl's
``verl/trainer/ppo/core_algos.py`` (``agg_loss``, ``compute_policy_loss_vanilla``,
``compute_policy_loss_gspo``, ``kl_penalty_forward``; read at commit b178a3cd, 2026-01-29);
where they differ, the docstring says how.
"""

from __future__ import annotations

import torch
from torch import Tensor

from asyncrl.algo import AGG_MODES, KL_KINDS, LOSS_NAMES

__all__ = [
    "AGG_MODES",
    "KL_KINDS",
    "LOSS_NAMES",
    "aggregate",
    "gspo_loss",
    "kl_penalty",
    "ppo_loss",
]

Normaliser = float | Tensor | None

# Beyond e^20 a ratio only says "far off-policy"; clamping keeps exp() finite in fp16/bf16.
_MAX_LOG_RATIO = 20.0


def _safe_div(num: Tensor, denom: float | Tensor) -> Tensor:
    # An all-padding micro-batch has a zero normaliser and a zero numerator; its share is 0.
    return num / torch.as_tensor(denom, dtype=num.dtype, device=num.device).clamp(min=1)


def _masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    return _safe_div((x * mask).sum(), mask.sum())


def _per_token(adv: Tensor, like: Tensor) -> Tensor:
    """Broadcast a ``[B]`` sequence-level advantage over the T tokens of each row."""
    if adv.dim() == like.dim() - 1:
        adv = adv.unsqueeze(-1)
    return adv.detach().expand_as(like)


def aggregate(
    loss_mat: Tensor,
    mask: Tensor,
    mode: str,
    *,
    global_tokens: Normaliser = None,
    global_seqs: Normaliser = None,
    horizon: int | None = None,
) -> Tensor:
    """Reduce a ``[B, T]`` per-token loss to a scalar (verl's ``agg_loss``).

    Modes (m = mask, L = loss_mat, "rows" = rows with at least one unmasked token, H =
    ``horizon``, by default ``T = mask.shape[-1]``):

    - ``token-mean``: ``Σ mL / Σ m``; every token weighs the same (DAPO).
    - ``seq-mean-token-mean``: mean over rows of ``Σ_t mL / Σ_t m`` (original GRPO, GSPO).
    - ``seq-mean-token-sum``: mean over rows of ``Σ_t mL``.
    - ``seq-mean-token-sum-norm``: ``Σ mL / H``, the sum over *all* rows divided by the
      horizon alone (Dr.GRPO as verl defines it: ``torch.sum(seq_losses) /
      loss_scale_factor``, ``loss_mask.shape[-1]`` when no factor is given). There is no
      division by the number of rows, so the loss, and its gradient, grow with the batch.
    - ``seq-mean-token-sum-horizon``: mean over rows of ``Σ_t mL / H``, i.e. ``Σ mL / (H ×
      rows)``: the batch-size-free variant. It is SkyRL's ``seq_mean_token_sum_norm`` and
      TRL's ``loss_type="dr_grpo"`` (which divide by all rows of the batch, where this
      counts non-empty rows, as the other ``seq-*`` modes do); not in verl.

    Pass a fixed ``horizon`` (verl's ``loss_scale_factor``) when micro-batches are padded to
    different widths, or each would use its own divisor.

    Global normalisers: by default the denominators (``Σ m``, number of rows) are those of
    this call's batch. When one step's batch is split over micro-batches or ranks, pass the
    step-wide totals, all-reduced: ``global_tokens`` for ``token-mean`` and ``global_seqs``
    (non-empty rows) for ``seq-mean-token-mean``, ``seq-mean-token-sum`` and
    ``seq-mean-token-sum-horizon``; ``seq-mean-token-sum-norm`` needs only the common
    ``horizon``; a normaliser a mode does not use is ignored. The results of the parts then
    *sum* to the single-process value on the whole batch, so gradients must be summed across
    ranks, not averaged (or each rank's loss multiplied by the world size when the
    data-parallel wrapper averages, as verl's ``dp_size`` factor does).

    Example: ``L = [[1, 2, 3], [4, 5, 6], [7, 8, 9]]``, ``m = [[1, 1, 0], [0, 0, 0],
    [1, 1, 1]]``: token-mean 27/5, seq-mean-token-mean (1.5 + 8)/2, seq-mean-token-sum
    (3 + 24)/2, seq-mean-token-sum-norm (3 + 24)/3 = 9, seq-mean-token-sum-horizon
    (3/3 + 24/3)/2 = 4.5.
    """
    if mode not in AGG_MODES:
        raise ValueError(f"unknown loss aggregation mode {mode!r}; allowed: {', '.join(AGG_MODES)}")
    m = mask.to(loss_mat.dtype)
    masked = loss_mat * m
    if mode == "token-mean":
        return _safe_div(masked.sum(), m.sum() if global_tokens is None else global_tokens)
    width = mask.shape[-1] if horizon is None else horizon
    if mode == "seq-mean-token-sum-norm":
        return masked.sum() / width
    tokens_per_row = m.sum(-1)
    row_loss = masked.sum(-1)
    if mode == "seq-mean-token-mean":
        row_loss = row_loss / tokens_per_row.clamp(min=1)
    elif mode == "seq-mean-token-sum-horizon":
        row_loss = row_loss / width
    n_seqs = (tokens_per_row > 0).sum() if global_seqs is None else global_seqs
    return _safe_div(row_loss.sum(), n_seqs)


def ppo_loss(
    logp: Tensor,
    old_logp: Tensor,
    adv: Tensor,
    mask: Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = 3.0,
    agg: str = "token-mean",
    weights: Tensor | None = None,
    global_tokens: Normaliser = None,
    global_seqs: Normaliser = None,
    horizon: int | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Clipped PPO surrogate with DAPO's asymmetric clip and dual clip for ``A < 0``.

    verl's ``compute_policy_loss_vanilla`` (``clip_ratio_low``/``clip_ratio_high``,
    ``clip_ratio_c``): ``r = exp(clamp(logp - old_logp, ±20))``, ``L = max(-A·r,
    -A·clip(r, 1-clip_low, 1+clip_high))``; where ``A < 0`` additionally ``L = min(L,
    -A·dual_clip)``, so a token whose ratio exploded cannot dominate the batch (verl always
    applies it; ``dual_clip=None`` disables it here). ``L`` is multiplied by ``weights``
    (detached; verl's ``rollout_is_weights``) after the clipping and reduced with
    :func:`aggregate` (``agg``, ``global_*`` and ``horizon`` are passed through).

    ``adv`` is ``[B]`` (broadcast over tokens) or ``[B, T]``; it and ``old_logp`` are treated
    as constants. Returned stats are detached means over unmasked tokens:
    ``clip_fraction`` (the clipped branch is active; verl's ``pg_clipfrac``),
    ``dual_clip_fraction`` (``pg_clipfrac_lower``), ``ratio_mean`` and ``approx_kl``, verl's
    ``ppo_kl``: the k1 estimate ``mean(-Δ)`` of KL(old ‖ new) from the clamped ``Δ``, unbiased
    but able to go negative on a small batch.

    Example: ``A = 1``, ``r = 1.5``, ``clip_high = 0.2``: ``L = max(-1.5, -1.2) = -1.2``,
    clipped. ``A = -1``, ``r = 5``: ``L = min(max(5, 1.2), 3) = 3``, dual-clipped.
    """
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1 (or None to disable), got {dual_clip}")
    m = mask.to(logp.dtype)
    adv = _per_token(adv, logp)
    log_ratio = (logp - old_logp.detach()).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    ratio = log_ratio.exp()
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss_mat = torch.maximum(unclipped, clipped)
    dual = torch.zeros_like(loss_mat, dtype=torch.bool)
    if dual_clip is not None:
        bound = -adv * dual_clip
        dual = (adv < 0) & (loss_mat > bound)
        loss_mat = torch.where(dual, bound, loss_mat)
    if weights is not None:
        loss_mat = loss_mat * weights.detach()
    loss = aggregate(
        loss_mat, m, agg, global_tokens=global_tokens, global_seqs=global_seqs, horizon=horizon
    )
    with torch.no_grad():
        stats = {
            "clip_fraction": _masked_mean((clipped > unclipped).to(m.dtype), m),
            "dual_clip_fraction": _masked_mean(dual.to(m.dtype), m),
            "approx_kl": _masked_mean(-log_ratio, m),
            "ratio_mean": _masked_mean(ratio, m),
        }
    return loss, stats


def gspo_loss(
    logp: Tensor,
    old_logp: Tensor,
    adv: Tensor,
    mask: Tensor,
    *,
    clip_low: float = 3e-4,
    clip_high: float = 4e-4,
    weights: Tensor | None = None,
    global_seqs: Normaliser = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """GSPO: PPO clipping on the length-normalised sequence ratio ``s_i``.

    ``log s_i = Σ_t m(logp - old_logp) / max(Σ_t m, 1)`` (the geometric mean of the token
    ratios). Its token form ``log s_it = logp - sg(logp) + sg(log s_i)``, clamped at ≤ 10,
    has value ``s_i`` on every token of row i and gradient ``s_i · ∇logp_it``, so with
    ``seq-mean-token-mean`` aggregation the gradient equals GSPO's sequence-level one,
    ``-A_i s_i / |y_i| Σ_t ∇logp_it`` per row, and clipping keeps or drops whole sequences.
    ``L = max(-A·s_it, -A·clip(s_it, 1-clip_low, 1+clip_high))``, times detached ``weights``;
    no dual clip. This is verl's ``compute_policy_loss_gspo``, which likewise aggregates with
    ``seq-mean-token-mean`` whatever ``loss_agg_mode`` is set.

    Stats (detached): ``clip_fraction`` over unmasked tokens, ``ratio_mean`` (mean of
    ``s_i`` over non-empty rows) and ``approx_kl`` as in :func:`ppo_loss`.

    Example: a row with token log-ratios ``[0.1, 0.3]`` has ``s = e^0.2``; with ``A = 1``
    and the default clip it is clipped, so that row contributes no gradient.
    """
    m = mask.to(logp.dtype)
    adv = _per_token(adv, logp)
    token_log_ratio = logp - old_logp.detach()
    tokens_per_row = m.sum(-1)
    log_seq_ratio = (token_log_ratio * m).sum(-1) / tokens_per_row.clamp(min=1)
    log_ratio = logp - logp.detach() + log_seq_ratio.detach().unsqueeze(-1)
    ratio = log_ratio.clamp(max=10.0).exp()
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss_mat = torch.maximum(unclipped, clipped)
    if weights is not None:
        loss_mat = loss_mat * weights.detach()
    loss = aggregate(loss_mat, m, "seq-mean-token-mean", global_seqs=global_seqs)
    with torch.no_grad():
        rows = (tokens_per_row > 0).to(m.dtype)
        stats = {
            "clip_fraction": _masked_mean((clipped > unclipped).to(m.dtype), m),
            "approx_kl": _masked_mean(-token_log_ratio, m),
            "ratio_mean": _masked_mean(log_seq_ratio.clamp(max=10.0).exp(), rows),
        }
    return loss, stats


def kl_penalty(logp: Tensor, ref_logp: Tensor, kind: str) -> Tensor:
    """Per-token estimate of KL(π ‖ π_ref) from log-probs of tokens sampled from π.

    verl's ``kl_penalty_forward``; verl's names in brackets:

    - ``k1`` (``kl``): ``logp - ref`` (unbiased, high variance, can be negative).
    - ``abs``: ``|logp - ref|``.
    - ``k2`` (``mse``): ``½(logp - ref)²`` (biased, low variance; its gradient is that of the
      true KL).
    - ``k3`` (``low_var_kl``): ``e^x - x - 1`` with ``x = clamp(ref - logp, ±20)``, clamped
      to ``[-10, 10]`` (unbiased, low variance, never negative).

    verl's straight-through variants (``k1+``, ``k3+``: k2's gradient under k1's or k3's
    value) are not offered.

    Example: ``logp = -1``, ``ref = -2``: k1 1, abs 1, k2 0.5, k3 ``e^-1 + 1 - 1 = 0.3679``.
    """
    diff = logp - ref_logp
    if kind == "k1":
        return diff
    if kind == "abs":
        return diff.abs()
    if kind == "k2":
        return 0.5 * diff.square()
    if kind == "k3":
        x = (-diff).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
        return (x.exp() - x - 1.0).clamp(-10.0, 10.0)
    raise ValueError(f"unknown KL estimator {kind!r}; allowed: {', '.join(KL_KINDS)}")
