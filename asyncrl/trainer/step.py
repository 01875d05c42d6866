"""One optimizer step of the decoupled objective over this rank's rows.

With one optimizer step per batch, π_prox (the policy at the start of the step) equals the
current policy, so `old_logp = sg(logp)` from the same forward pass is exactly the "recomputed
once, no grad" proximal log-prob of DESIGN §6, without a second forward. The PPO ratio is then 1
and the update is the truncated-IS policy gradient weighted by behaviour_weights(π_prox, π_behav).

Normalisers (token count, non-empty rows, response horizon) are summed over micro-batches and
all-reduced over ranks before any loss is computed, and gradients are summed (not averaged) over
ranks — by one all-reduce here, or by FSDP's reduce-scatter for a sharded model — so N ranks give
the update of one rank on the whole batch. Every rank runs the same number of forward and backward
passes (padding with empty micro-batches), which a sharded model's collectives need.

With `algo.correction=mask` the rejected tokens leave the loss mask, as in verl, so they must also
leave the normalisers; but which tokens are rejected is known only after each micro-batch's
forward. The loss is therefore built with the normalisers of the unmasked batch, and once every
micro-batch has run, the gradients (all terms share the normaliser) are multiplied by
normaliser(all) / normaliser(kept), all-reduced — exact, since the loss is linear in 1/normaliser.

A step whose loss or gradient norm is not finite is skipped (the optimizer does not step): one
overflowing batch must not turn the weights into NaN. Both figures are global, so every rank
skips together.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from functools import partial
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from asyncrl.algo.config import AlgoConfig
from asyncrl.algo.correction import behaviour_mask_weights, behaviour_weights
from asyncrl.algo.losses import aggregate, gspo_loss, kl_penalty, ppo_loss
from asyncrl.algo.mismatch import (
    MismatchTable,
    RoutingAgreement,
    mismatch_table,
    response_positions,
)
from asyncrl.engines.head import head_logprobs
from asyncrl.engines.routing import moe_shape, routing_hooks
from asyncrl.engines.sampling import SamplingParams
from asyncrl.lora import adapter_disabled
from asyncrl.metrics.breakdown import phase
from asyncrl.metrics.record import StepRecord
from asyncrl.trainer.batch import MicroBatch, Row, collate
from asyncrl.trainer.packing import pack_microbatches
from asyncrl.trainer.parallel import global_value, is_sharded


def _as(record_field: str) -> Any:
    """Field metadata: the `StepRecord` figure a `StepStats` field becomes, under another name."""
    return {"record": record_field}


_RECORD_FIELDS = {f.name for f in fields(StepRecord)}


@dataclass
class StepStats:
    """What one optimizer step measured. A field named as a `StepRecord` figure (or naming one in
    its metadata, `_as`) is that figure of the step's record, by field: a new figure is a field
    here and there (and a row in `metrics.table` to export it)."""

    loss: float
    grad_norm: float
    tokens: int
    clip_fraction: float
    behaviour_weight_mean: float
    behaviour_weight_capped_fraction: float
    logprob_abs_diff_lag0: float | None = field(metadata=_as("behaviour_logprob_abs_diff_lag0"))
    lag0_tokens: int
    weight_quantiles: tuple[float, float, float] | None
    """p50/p90/p99 of the behaviour weights of this rank's trained tokens; None without any."""
    processed_tokens: int
    """Prompt and response tokens through forward and backward, all ranks (for MFU)."""
    mismatch: MismatchTable
    """Trainer (π_prox) against behaviour log-probs of the trained tokens, every lag, all ranks."""
    audit: MismatchTable
    """The workers' audit (`audited`) against behaviour log-probs: lag 0 only, all ranks."""
    skipped: bool = field(default=False, metadata=_as("skipped_nonfinite"))
    """The loss or the gradient norm was not finite: the optimizer did not step."""
    routing: RoutingAgreement | None = None
    """Rollout against trainer routing per MoE layer, all ranks; None for a dense model."""

    def figures(self) -> dict[str, Any]:
        """The step record's figures this step measured: its fields by their record name, then
        those derived from the weight quantiles and the tables."""
        named = {f.metadata.get("record", f.name): getattr(self, f.name) for f in fields(self)}
        p50, p90, p99 = self.weight_quantiles or (None, None, None)
        return {k: v for k, v in named.items() if k in _RECORD_FIELDS} | {
            "behaviour_weight_p50": p50,
            "behaviour_weight_p90": p90,
            "behaviour_weight_p99": p99,
            "mismatch_logprob_abs_diff": self.mismatch.abs_diff_mean(),
            "mismatch_ratio_mean": self.mismatch.ratio_mean(),
            "audit_tokens": self.audit.tokens or None,
            "audit_logprob_abs_diff": self.audit.abs_diff_mean(),
            "audit_logprob_abs_diff_low_prob": self.audit.abs_diff_mean(low_prob=True),
            "audit_logprob_abs_diff_high_prob": self.audit.abs_diff_mean(low_prob=False),
            **self._routing_figures(),
        }

    def _routing_figures(self) -> dict[str, Any]:
        """None for a dense model or without a recorded routing."""
        routing = self.routing
        if routing is None or not routing.tokens:
            return {}
        return {
            "routing_tokens": routing.tokens,
            "routing_agreement": routing.mean(),
            "routing_agreement_router": routing.mean(router=True),
            "routing_agreement_worst_layer": routing.worst_layer(),
        }


def token_logprobs(
    model: torch.nn.Module,
    mb: MicroBatch,
    sampling: SamplingParams,
    *,
    replay: bool = False,
    agreement: RoutingAgreement | None = None,
    chunk_tokens: int = 0,
) -> torch.Tensor:
    """Log-prob of each target token under the sampling distribution, [B, L-1]. For rows with
    a recorded routing, `replay` routes their tokens as the rollout did (R3) and `agreement`
    gets the comparison of the two routings. `chunk_tokens`: `trainer.logits_chunk_tokens`."""
    forward = partial(head_logprobs, chunk_tokens=chunk_tokens)
    if mb.routed is None or mb.routed_mask is None or agreement is None:
        out = forward(model, mb.input_ids, sampling)
    else:
        with routing_hooks(model, mb.routed if replay else None, mb.routed_mask) as routing:
            out = forward(model, mb.input_ids, sampling)
        rows = len(mb.input_ids)
        agreement.add(
            mb.routed, routing.stacked(rows), routing.stacked(rows, own=True), mb.routed_mask
        )
    # Off-response positions may hold -inf under top-k/top-p; they are masked, keep them finite.
    return torch.where(mb.mask > 0, out, torch.zeros_like(out))


def _all_reduce(
    values: list[float], world: dist.ProcessGroup | None, op: Any = None
) -> list[float]:
    if world is None:
        return values
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=op or dist.ReduceOp.SUM, group=world)
    return t.tolist()


def _all_reduce_grads(params: list[torch.nn.Parameter], world: dist.ProcessGroup) -> None:
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=world)
    offset = 0
    for p, g in zip(params, grads, strict=True):
        n = g.numel()
        p.grad = flat[offset : offset + n].view_as(p).clone()
        offset += n


def train_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    rows: list[Row],
    *,
    algo: AlgoConfig,
    sampling: SamplingParams,
    micro_batch_tokens: int,
    logits_chunk_tokens: int = 0,
    grad_clip: float,
    current_version: int,
    ref_model: torch.nn.Module | None = None,
    world: dist.ProcessGroup | None = None,
    device: torch.device | str = "cpu",
    audited: MismatchTable | None = None,
) -> StepStats:
    """Forward/backward over packed micro-batches of `rows`, all-reduce, clip, step.
    `logits_chunk_tokens`: `trainer.logits_chunk_tokens` (0, the whole logits, by default).
    `audited`: this rank's table of the workers' audit (`audit_table`), summed over ranks."""
    model.train()
    horizon_local = max((r.length - r.n_prompt for r in rows), default=1)
    # Rows without a trained token (zero-variance groups once most answers are right) change
    # neither the loss nor its normalisers: skipping them saves their forward and backward.
    rows = [r for r in rows if r.loss_mask.any()]
    local_tokens = float(sum(r.loss_mask.sum() for r in rows))
    local_seqs = float(len(rows))
    bins = [b for b in pack_microbatches([r.length for r in rows], micro_batch_tokens)[0] if b]
    g_tokens, g_seqs = _all_reduce([local_tokens, local_seqs], world)
    # Every rank runs the same number of micro-batches; missing ones are fully masked dummies.
    n_bins, horizon = (
        int(v)
        for v in _all_reduce([float(len(bins)), float(horizon_local)], world, dist.ReduceOp.MAX)
    )
    if algo.loss_scale_factor is not None:
        horizon = algo.loss_scale_factor
    masking = algo.correction == "mask"
    sums = dict(loss=0.0, clip=0.0, w=0.0, capped=0.0, diff=0.0, lag0=0.0, kept=0.0, kept_seqs=0.0)
    trained_weights: list[torch.Tensor] = []
    mismatch = MismatchTable.empty()
    moe = moe_shape(model)
    agreement = RoutingAgreement.empty(moe.layers) if moe is not None else None
    for i in range(n_bins):
        # Collation and the proximal weights are charged to their own phases, nested here.
        with phase("forward_backward"):
            with phase("collate"):
                idx = bins[i] if i < len(bins) else []
                mb = collate([rows[j] for j in idx] or [_DUMMY_ROW], device)
                if not idx:
                    mb.mask.zero_()
            logp = token_logprobs(
                model,
                mb,
                sampling,
                replay=algo.routing_replay,
                agreement=agreement,
                chunk_tokens=logits_chunk_tokens,
            )
            with phase("proximal"):
                prox = logp.detach()
                weights = _correction(prox, mb, algo)
            # Masking rejects tokens: they leave the loss mask (verl's modified response_mask).
            loss_mask = weights if masking and weights is not None else mb.mask
            loss_weights = None if masking else weights
            objective = (
                gspo_loss
                if algo.loss == "gspo"
                else partial(
                    ppo_loss,
                    dual_clip=algo.dual_clip,
                    agg=algo.aggregation,
                    global_tokens=g_tokens,
                    horizon=horizon,
                )
            )
            loss, stats = objective(
                logp,
                prox,
                mb.advantages,
                loss_mask,
                clip_low=algo.clip_low,
                clip_high=algo.clip_high,
                weights=loss_weights,
                global_seqs=g_seqs,
            )
            if ref_model is not None and algo.kl_coef > 0 and algo.kl_in == "loss":
                with torch.no_grad(), adapter_disabled(ref_model):
                    ref_logp = token_logprobs(
                        ref_model, mb, sampling, chunk_tokens=logits_chunk_tokens
                    )
                kl = kl_penalty(logp, ref_logp, algo.kl_kind)
                loss = loss + algo.kl_coef * aggregate(
                    kl,
                    loss_mask,
                    algo.aggregation,
                    global_tokens=g_tokens,
                    global_seqs=g_seqs,
                    horizon=horizon,
                )
            loss.backward()
            n_kept = float(loss_mask.sum())
            sums["kept"] += n_kept
            sums["kept_seqs"] += float((loss_mask.sum(-1) > 0).sum())
            w = weights if weights is not None else mb.mask
            # Lag 0 is a property of a whole response: a token after an in-flight swap carries the
            # current version but attended to keys the older weights computed.
            on_response = torch.where(mb.versions >= 0, mb.versions, current_version)
            row_lag0 = (on_response.min(-1, keepdim=True).values == current_version) & (
                mb.versions.max(-1, keepdim=True).values == current_version
            )
            lag0 = row_lag0.float() * mb.mask
            trained_weights.append(w[mb.mask > 0].detach().float())
            sums["loss"] += float(loss.detach())
            sums["clip"] += float(stats["clip_fraction"]) * n_kept
            sums["w"] += float((w * mb.mask).sum())
            sums["capped"] += float(((w >= algo.weight_cap) & (mb.mask > 0)).sum())
            sums["diff"] += float(((prox - mb.behav_logp).abs() * lag0).sum())
            sums["lag0"] += float(lag0.sum())
            # A response's lag is its staleness (trainer version − its oldest token's), so lag 0
            # holds exactly the responses of `logprob_abs_diff_lag0`: tokens after an in-flight swap
            # attended to keys of older weights and are not pure engine mismatch.
            oldest = on_response.min(-1, keepdim=True).values
            lag = (current_version - oldest).expand_as(mb.versions)
            positions = response_positions(mb.versions >= 0)
            mismatch.add(mismatch_table(prox, mb.behav_logp, mb.mask, lag, positions))
    sums["processed"] = float(sum(r.length for r in rows))
    keys = list(sums)
    params = [p for p in model.parameters() if p.requires_grad]
    with phase("all_reduce"):
        totals = dict(zip(keys, _all_reduce([sums[k] for k in keys], world), strict=True))
        if world is not None and not is_sharded(model):
            _all_reduce_grads(params, world)  # FSDP has reduce-scattered them in backward
    if masking:
        scale = _rejection_rescale(algo, (g_tokens, g_seqs), (totals["kept"], totals["kept_seqs"]))
        totals["loss"] *= scale
        for p in params:
            if p.grad is not None:
                p.grad.mul_(scale)
    with phase("optimizer"):
        # Over sharded gradients the norm is a DTensor: the global norm, the same on every rank.
        grad_norm = global_value(torch.nn.utils.clip_grad_norm_(params, grad_clip))
        skipped = not (math.isfinite(grad_norm) and math.isfinite(totals["loss"]))
        if not skipped:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    tokens = max(g_tokens, 1.0)
    return StepStats(
        loss=totals["loss"],
        grad_norm=grad_norm,
        tokens=int(g_tokens),
        clip_fraction=totals["clip"] / max(totals["kept"], 1.0),
        behaviour_weight_mean=totals["w"] / tokens,
        behaviour_weight_capped_fraction=totals["capped"] / tokens,
        logprob_abs_diff_lag0=totals["diff"] / totals["lag0"] if totals["lag0"] else None,
        lag0_tokens=int(totals["lag0"]),
        weight_quantiles=_quantiles(torch.cat(trained_weights) if trained_weights else None),
        processed_tokens=int(totals["processed"]),
        mismatch=_all_reduce_table(mismatch, world),
        audit=_all_reduce_table(audited or MismatchTable.empty(), world),
        skipped=skipped,
        routing=_all_reduce_agreement(agreement, world),
    )


def _all_reduce_agreement(
    agreement: RoutingAgreement | None, world: dist.ProcessGroup | None
) -> RoutingAgreement | None:
    if agreement is not None and world is not None:
        dist.all_reduce(agreement.counts, group=world)
    return agreement


def _all_reduce_table(table: MismatchTable, world: dist.ProcessGroup | None) -> MismatchTable:
    if world is None:
        return table
    sums, maxes = table.parts()
    dist.all_reduce(sums, group=world)
    dist.all_reduce(maxes, op=dist.ReduceOp.MAX, group=world)
    return MismatchTable.from_parts(sums, maxes)


def weights_finite(model: torch.nn.Module, world: dist.ProcessGroup | None = None) -> bool:
    """Whether every parameter is finite on every rank (each checks its own shards; one small
    all-reduce). A finite gradient times a huge learning rate can still overflow the weights."""
    from torch.distributed.tensor import DTensor

    local = [p.to_local() if isinstance(p, DTensor) else p for p in model.parameters()]
    # One device sync for the whole model, not one per parameter.
    finite = bool(torch.stack([torch.isfinite(p.detach()).all() for p in local]).all())
    (bad,) = _all_reduce([0.0 if finite else 1.0], world, dist.ReduceOp.MAX)
    return bad == 0


def _quantiles(values: torch.Tensor | None) -> tuple[float, float, float] | None:
    if values is None or values.numel() == 0:
        return None
    p50, p90, p99 = torch.quantile(values, torch.tensor([0.5, 0.9, 0.99])).tolist()
    return p50, p90, p99


def _rejection_rescale(
    algo: AlgoConfig, normalisers: tuple[float, float], kept: tuple[float, float]
) -> float:
    """Factor turning a loss normalised over all tokens into one normalised over the tokens
    masking kept: (tokens, non-empty rows) of the whole step, then of the kept tokens."""
    mode = "seq-mean-token-mean" if algo.loss == "gspo" else algo.aggregation
    if mode == "seq-mean-token-sum-norm":
        return 1.0  # divided by the horizon alone, which rejection does not change
    (tokens, seqs), (kept_tokens, kept_seqs) = normalisers, kept
    full, part = (tokens, kept_tokens) if mode == "token-mean" else (seqs, kept_seqs)
    # Nothing kept: every gradient is 0 already. The loss divided by max(·, 1), as aggregate does.
    return max(full, 1.0) / max(part, 1.0) if part > 0 else 1.0


def _correction(prox: torch.Tensor, mb: MicroBatch, algo: AlgoConfig) -> torch.Tensor | None:
    if algo.correction == "none":
        return None
    if algo.correction == "mask":
        return behaviour_mask_weights(
            prox,
            mb.behav_logp,
            mb.mask,
            level=algo.correction_level,
            lo=algo.mask_low,
            hi=algo.mask_high,
        )
    return behaviour_weights(
        prox, mb.behav_logp, mb.mask, level=algo.correction_level, cap=algo.weight_cap
    )


# A one-token placeholder for a rank with fewer micro-batches; its mask is zeroed.
_DUMMY_ROW = Row(
    input_ids=np.zeros(2, np.int64),
    n_prompt=1,
    behav_logp=np.zeros(1, np.float32),
    versions=np.zeros(1, np.int32),
    loss_mask=np.zeros(1, np.float32),
    advantage=0.0,
    reward=0.0,
)
