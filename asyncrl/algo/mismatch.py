"""The train/inference mismatch table: |Δ log p| and the importance ratio, split by lag, by
position in the response and by behaviour probability.

Δ log p = trainer log-prob − behaviour log-prob of the same sampled token; the ratio is
exp(Δ log p) = π_trainer / π_behaviour. At lag 0 (the same weights on both sides) the gap is pure
engine mismatch — dtype, kernels, KV-cached decoding against one full forward; at lag k ≥ 1 it
is that plus k optimizer steps of policy change.

The table holds sums, not means (`STATS` per cell), so tables of micro-batches, ranks and
steps add up; `summarise` turns one into means. Buckets are fixed (edges below), so a table has
one shape everywhere and travels as one flat tensor through an all-reduce.

Worked example: trainer log-probs (-0.1, -3.0), behaviour (-0.1, -2.0), both tokens at lag 0,
positions 0 and 1. Token 1 has behaviour probability e^-2 ≈ 0.135, in the bucket [0.1, 0.5);
token 0 (p ≈ 0.905) in [0.9, 1]. The lag-0 row holds |Δ| sums 1.0 at [0.1, 0.5) and 0.0 at
[0.9, 1], ratio sums e^-1 and 1.0, and one token each.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from itertools import pairwise
from typing import Any

import numpy as np
import torch

LAG_EDGES = (1, 2, 3, 4)
"""Lag buckets 0, 1, 2, 3, ≥ 4 of a token: trainer version − the oldest version in its response
(the response's staleness; the audit's tokens are at lag 0)."""
POSITION_EDGES = (8, 16, 32, 64)
"""Position buckets of the token in its response (0 = first generated token)."""
PROB_EDGES = (0.01, 0.1, 0.5, 0.9)
"""Behaviour-probability buckets: < 0.01, [0.01, 0.1), [0.1, 0.5), [0.5, 0.9), ≥ 0.9."""
STATS = ("tokens", "abs_diff", "ratio", "abs_diff_max")
"""Per cell: token count, Σ |Δ log p|, Σ exp(Δ log p), max |Δ log p|."""
LOW_PROB = 0.1
"""Behaviour probability under which a token counts as low-probability in the step line."""


def _labels(edges: tuple[float, ...]) -> tuple[str, ...]:
    cuts = [f"{e:g}" for e in edges]
    return (f"<{cuts[0]}", *(f"{a}-{b}" for a, b in pairwise(cuts)), f">={cuts[-1]}")


LAG_LABELS = ("0", "1", "2", "3", ">=4")
POSITION_LABELS = _labels(POSITION_EDGES)
PROB_LABELS = _labels(PROB_EDGES)


@dataclass
class MismatchTable:
    """Sums per (lag bucket, other bucket, stat): `by_prob` [lags, prob buckets, STATS],
    `by_position` [lags, position buckets, STATS]; float64."""

    by_prob: torch.Tensor
    by_position: torch.Tensor

    @classmethod
    def empty(cls) -> MismatchTable:
        lags = len(LAG_EDGES) + 1
        return cls(
            torch.zeros(lags, len(PROB_EDGES) + 1, len(STATS), dtype=torch.float64),
            torch.zeros(lags, len(POSITION_EDGES) + 1, len(STATS), dtype=torch.float64),
        )

    def add(self, other: MismatchTable) -> None:
        for mine, theirs in ((self.by_prob, other.by_prob), (self.by_position, other.by_position)):
            mine[..., :3] += theirs[..., :3]
            mine[..., 3] = torch.maximum(mine[..., 3], theirs[..., 3])

    @property
    def tokens(self) -> int:
        return int(self.by_prob[..., 0].sum())

    def abs_diff_mean(self, lag: int | None = None, low_prob: bool | None = None) -> float | None:
        """Mean |Δ log p| over the tokens of lag bucket `lag` (None: every lag) whose behaviour
        probability is below `LOW_PROB` (True), at or above it (False) or any (None); None
        without such a token."""
        cells = self.by_prob if lag is None else self.by_prob[lag : lag + 1]
        cut = PROB_EDGES.index(LOW_PROB) + 1
        if low_prob is not None:
            cells = cells[:, :cut] if low_prob else cells[:, cut:]
        n = float(cells[..., 0].sum())
        return float(cells[..., 1].sum()) / n if n else None

    def ratio_mean(self) -> float | None:
        n = float(self.by_prob[..., 0].sum())
        return float(self.by_prob[..., 2].sum()) / n if n else None

    def parts(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(the sum columns, the `abs_diff_max` column), each flat: an all-reduce sums the
        first and takes the MAX of the second."""
        cells = (self.by_prob, self.by_position)
        return (
            torch.cat([c[..., :3].reshape(-1) for c in cells]),
            torch.cat([c[..., 3].reshape(-1) for c in cells]),
        )

    @classmethod
    def from_parts(cls, sums: torch.Tensor, maxes: torch.Tensor) -> MismatchTable:
        t = cls.empty()
        n = t.by_prob[..., 0].numel()
        for cells, lo, hi in ((t.by_prob, 0, n), (t.by_position, n, maxes.numel())):
            cells[..., :3] = sums[3 * lo : 3 * hi].reshape(*cells.shape[:2], 3)
            cells[..., 3] = maxes[lo:hi].reshape(cells.shape[:2])
        return t


def mismatch_table(
    trainer_logp: torch.Tensor,
    behav_logp: torch.Tensor,
    mask: torch.Tensor,
    lag: torch.Tensor,
    position: torch.Tensor,
) -> MismatchTable:
    """The table of the tokens where `mask` > 0; every argument has the same shape (any).

    `lag` and `position` are integers per token; a -inf trainer log-prob (a token outside the
    trainer's top-k/top-p) gives an infinite |Δ| and ratio 0, kept as such.
    """
    keep = mask > 0
    trainer, behav = trainer_logp[keep].double(), behav_logp[keep].double()
    diff = trainer - behav
    stats = torch.stack([torch.ones_like(diff), diff.abs(), diff.exp()], dim=-1)
    lag_b = torch.bucketize(lag[keep], torch.tensor(LAG_EDGES, device=lag.device), right=True)
    prob_b = torch.bucketize(behav.exp(), torch.tensor(PROB_EDGES, dtype=torch.float64), right=True)
    pos_b = torch.bucketize(
        position[keep], torch.tensor(POSITION_EDGES, device=position.device), right=True
    )
    table = MismatchTable.empty()
    for out, other in ((table.by_prob, prob_b), (table.by_position, pos_b)):
        lags, buckets, _ = out.shape
        cell = (lag_b * buckets + other).cpu()
        sums = torch.zeros(lags * buckets, 3, dtype=torch.float64)
        sums.index_add_(0, cell, stats.cpu())
        top = torch.zeros(lags * buckets, dtype=torch.float64)
        top.scatter_reduce_(0, cell, diff.abs().cpu(), reduce="amax")
        out[..., :3] = sums.view(lags, buckets, 3)
        out[..., 3] = top.view(lags, buckets)
    return table


def audit_table(
    samples: Iterable[tuple[np.ndarray, np.ndarray, np.ndarray | None]],
) -> MismatchTable:
    """The lag-0 table of audited samples: (audit log-probs, behaviour log-probs, loss mask or
    None for all tokens) each, one entry per response token; observation tokens (mask 0) are
    left out."""
    table = MismatchTable.empty()
    for audit, behav, mask in samples:
        n = len(behav)
        keep = torch.ones(n) if mask is None else torch.from_numpy(mask.astype(np.float32))
        zeros = torch.zeros(n, dtype=torch.long)
        # Positions count every response token, observations included, as in the trainer's table.
        positions = torch.arange(n)
        table.add(
            mismatch_table(torch.from_numpy(audit), torch.from_numpy(behav), keep, zeros, positions)
        )
    return table


def response_positions(on_response: torch.Tensor) -> torch.Tensor:
    """Index of each token within its response along the last dim (0 = first response token)
    from a boolean mask of the response columns; off-response columns get -1."""
    return torch.where(on_response, on_response.long().cumsum(-1) - 1, -1)


def summarise(table: MismatchTable) -> dict[str, Any]:
    """The table as JSON: per lag bucket with tokens, the means of |Δ| and ratio, and max |Δ|
    per probability and position bucket (null where a cell has no token)."""

    def cells(sums: torch.Tensor, labels: tuple[str, ...]) -> dict[str, Any]:
        out = {}
        for label, (n, diff, ratio, top) in zip(labels, sums.tolist(), strict=True):
            if n:
                out[label] = {
                    "tokens": int(n),
                    "abs_diff": _finite(diff / n),
                    "ratio": _finite(ratio / n),
                    "abs_diff_max": _finite(top),
                }
        return out

    lags = {}
    for i, label in enumerate(LAG_LABELS):
        if table.by_prob[i, :, 0].sum():
            lags[label] = {
                "by_prob": cells(table.by_prob[i], PROB_LABELS),
                "by_position": cells(table.by_position[i], POSITION_LABELS),
            }
    return lags


@dataclass
class RoutingAgreement:
    """Routing agreement between rollout and trainer of a mixture-of-experts model, per MoE
    layer, as sums: `counts` [layers, 3] = tokens compared, tokens whose experts in the
    trainer's forward had the rollout's top-k set (1.0 under routing replay, by construction),
    and tokens whose trainer router picked that set itself (the same as the second without
    replay). Sets, not ordered lists: the experts' outputs are summed, so order is moot."""

    counts: torch.Tensor

    @classmethod
    def empty(cls, layers: int) -> RoutingAgreement:
        return cls(torch.zeros(layers, 3, dtype=torch.float64))

    def add(
        self,
        recorded: torch.Tensor,
        used: torch.Tensor,
        own: torch.Tensor,
        known: torch.Tensor,
    ) -> None:
        """`recorded`, `used`, `own`: [B, L, layers, k] expert ids; `known` [B, L] bool, the
        tokens that have a recorded routing."""
        keep = known.bool()
        rec = recorded[keep]  # [tokens, layers, k]
        self.counts[:, 0] += float(keep.sum())
        self.counts[:, 1] += same_sets(rec, used[keep].to(rec)).sum(0).double().cpu()
        self.counts[:, 2] += same_sets(rec, own[keep].to(rec)).sum(0).double().cpu()

    @property
    def tokens(self) -> int:
        return int(self.counts[0, 0]) if len(self.counts) else 0

    def mean(self, *, router: bool = False) -> float | None:
        """Agreement over every layer's tokens (of the router's own picks with `router`)."""
        n = float(self.counts[:, 0].sum())
        return float(self.counts[:, 2 if router else 1].sum()) / n if n else None

    def worst_layer(self) -> float | None:
        """The lowest per-layer agreement of the experts used."""
        if not self.tokens:
            return None
        return float((self.counts[:, 1] / self.counts[:, 0]).min())

    def summary(self) -> dict[str, Any] | None:
        """Per layer, as JSON (`mismatch.jsonl`); None without a compared token."""
        if not self.tokens:
            return None
        n = self.counts[:, 0]
        return {
            "tokens": self.tokens,
            "agreement": (self.counts[:, 1] / n).tolist(),
            "router_agreement": (self.counts[:, 2] / n).tolist(),
        }


def same_sets(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Whether the top-k sets of `a` and `b` ([..., k] ids) are equal, per token (and layer)."""
    return (a.sort(dim=-1).values == b.sort(dim=-1).values).all(dim=-1)


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None
