"""Staleness as the trainer treats it: how old each token is, and what dropping does to lengths.

Versions: a token's lag is the trainer's version minus the version of the weights that produced
it; a group's staleness is the lag of its oldest token. Under `algo.stale_policy: train` no group
is dropped for staleness, but a token whose lag exceeds a limit leaves the loss
(:func:`token_lag_keep`): its truncated importance weight ``min(π_prox/π_behav, cap)`` has its
variance bounded by the cap whatever its age, but the mass the cap cuts off, the bias, grows
with the lag, so far-off tokens would pull toward the behaviour policy they came from. Masking
them costs those tokens only: the group's reward still shapes its siblings' advantages and the
newer turns of a long episode — generated after the in-flight weight swaps — are trained.

Length bias: a policy that drops stale groups drops the slow ones, so the groups trained are
shorter than the groups generated. :func:`ks_statistic` is the two-sample Kolmogorov–Smirnov
statistic of the two length samples (scipy's ``ks_2samp(a, b).statistic``): 0 when nothing was
dropped, toward 1 as the trained lengths separate from the generated ones.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["episode_turns", "ks_statistic", "token_lag_keep"]


def token_lag_keep(versions: np.ndarray, current_version: int, max_lag: int) -> np.ndarray:
    """float32 0/1 per token: 1 where ``current_version − version ≤ max_lag``.

    Example: versions ``[3, 3, 5, 6]`` at version 7 with ``max_lag=2`` give ``[0, 0, 1, 1]``
    (lags 4, 4, 2, 1).
    """
    lag = current_version - np.asarray(versions, np.int64)
    return (lag <= max_lag).astype(np.float32)


def episode_turns(loss_mask: np.ndarray | None) -> int:
    """Generated turns of a sample: the runs of trained tokens in its loss mask (observations
    between turns are masked out); a sample without a mask is one turn.

    Example: mask ``[1, 1, 0, 0, 1, 0, 1]`` holds 3 turns.
    """
    if loss_mask is None:
        return 1
    on = np.asarray(loss_mask) > 0
    if not on.size:
        return 0
    return int(on[0]) + int(np.count_nonzero(on[1:] & ~on[:-1]))


def ks_statistic(a: Sequence[float] | np.ndarray, b: Sequence[float] | np.ndarray) -> float:
    """``sup_x |F_a(x) − F_b(x)|`` of the two samples' empirical distributions; 0 when either
    is empty (nothing to compare).

    Example: ``a = [1, 2, 3, 4, 10, 12]`` (generated) and ``b = [1, 2, 3, 4]`` (trained): at
    x = 4, F_a = 4/6 and F_b = 1, so the statistic is 1/3.
    """
    xa = np.sort(np.asarray(a, np.float64))
    xb = np.sort(np.asarray(b, np.float64))
    if not xa.size or not xb.size:
        return 0.0
    grid = np.concatenate([xa, xb])
    fa = np.searchsorted(xa, grid, side="right") / xa.size
    fb = np.searchsorted(xb, grid, side="right") / xb.size
    return float(np.abs(fa - fb).max())
