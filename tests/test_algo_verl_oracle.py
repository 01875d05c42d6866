"""verl as the oracle: values worked by hand from verl's formulas.

Read in volcengine/verl at commit b178a3cd (2026-01-29). Each test names the verl function its
numbers follow; the arithmetic is in the comments, so a reader can check it without verl.
No verl code is run or copied here.

- `verl/trainer/ppo/core_algos.py`: `agg_loss`, `compute_policy_loss_vanilla`,
  `compute_policy_loss_gspo`, `kl_penalty_forward`, `compute_grpo_outcome_advantage`,
  `compute_rloo_outcome_advantage`, `compute_rloo_vectorized_outcome_advantage`.
- `verl/trainer/ppo/rollout_corr_helper.py`: `compute_rollout_correction_weights`,
  `compute_rollout_rejection_mask`.
"""

from __future__ import annotations

import math

import pytest
import torch

from asyncrl.algo.advantages import grpo_advantages, rloo_advantages
from asyncrl.algo.correction import behaviour_mask_weights, behaviour_weights
from asyncrl.algo.losses import aggregate, gspo_loss, kl_penalty, ppo_loss


def f64(rows: list[list[float]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float64)


# Row sums of L·m: [6, 4]; token counts [3, 1]; the third row is fully masked.
L = f64([[1, 2, 3], [4, 5, 6], [7, 8, 9]])
M = f64([[1, 1, 1], [1, 0, 0], [0, 0, 0]])


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        # masked_sum(L, m) / m.sum() = 10 / 4
        ("token-mean", 10 / 4),
        # seq_losses [6, 4, 0]; seq_mask excludes the empty row: (6 + 4) / 2
        ("seq-mean-token-sum", 5.0),
        # seq_losses / (seq_mask + 1e-8) = [2, 4, 0]; (2 + 4) / 2
        ("seq-mean-token-mean", 3.0),
        # torch.sum(seq_losses) / loss_mask.shape[-1] = (6 + 4 + 0) / 3: no division by rows
        ("seq-mean-token-sum-norm", 10 / 3),
    ],
)
def test_agg_loss_single_process(mode: str, expected: float) -> None:
    """verl `agg_loss(loss_mat, loss_mask, mode)` with no global batch info."""
    assert aggregate(L, M, mode).item() == pytest.approx(expected)


def test_agg_loss_seq_mean_token_sum_norm_loss_scale_factor_and_batch_size() -> None:
    """verl `agg_loss(..., "seq-mean-token-sum-norm", loss_scale_factor=5)`: (6 + 4) / 5 = 2.
    The loss sums over rows, so the same batch twice gives twice the loss (20 / 3), where every
    mean mode gives the same value. The batch-size-free variant, not in verl, is our
    `seq-mean-token-sum-horizon`: (6/3 + 4/3) / 2 = 5/3 whatever the batch size."""
    mode = "seq-mean-token-sum-norm"
    assert aggregate(L, M, mode, horizon=5).item() == pytest.approx(2.0)
    twice_l, twice_m = torch.cat([L, L]), torch.cat([M, M])
    assert aggregate(twice_l, twice_m, mode).item() == pytest.approx(20 / 3)
    assert aggregate(twice_l, twice_m, "token-mean").item() == pytest.approx(10 / 4)
    for batch_l, batch_m in ((L, M), (twice_l, twice_m)):
        out = aggregate(batch_l, batch_m, "seq-mean-token-sum-horizon")
        assert out.item() == pytest.approx(5 / 3)


@pytest.mark.parametrize(
    ("mode", "verl_ranks_mean", "whole"),
    [
        # batch_num_tokens=4, dp_size=2: rank 0 6/4·2 = 3, rank 1 4/4·2 = 2, averaged: 2.5
        ("token-mean", (3.0 + 2.0) / 2, 2.5),
        # global_batch_size=2, dp_size=2: rank 0 6/2·2 = 6, rank 1 4/2·2 = 4, averaged: 5
        ("seq-mean-token-sum", (6.0 + 4.0) / 2, 5.0),
        # rank 0 2/2·2 = 2, rank 1 4/2·2 = 4, averaged: 3
        ("seq-mean-token-mean", (2.0 + 4.0) / 2, 3.0),
        # no dp_size factor in this branch: rank 0 6/3 = 2, rank 1 4/3, averaged 5/3, i.e. half
        # the single-process 10/3. We keep the single-process value on every partition.
        ("seq-mean-token-sum-norm", (2.0 + 4 / 3) / 2, 10 / 3),
    ],
)
def test_agg_loss_over_two_data_parallel_ranks(
    mode: str, verl_ranks_mean: float, whole: float
) -> None:
    """verl's engine path (`verl/workers/utils/losses.py::ppo_loss` feeding `agg_loss` the
    all-reduced `batch_num_tokens`, `global_batch_size` and `dp_size`) with gradients averaged
    over ranks, against our parts with global normalisers, which are summed over ranks. Rank 0
    holds row 0, rank 1 row 1 (the empty row dropped)."""
    parts = [
        aggregate(L[i : i + 1], M[i : i + 1], mode, global_tokens=4, global_seqs=2, horizon=3)
        for i in (0, 1)
    ]
    assert sum(p.item() for p in parts) == pytest.approx(whole)
    assert aggregate(L, M, mode).item() == pytest.approx(whole)
    if mode == "seq-mean-token-sum-norm":
        assert verl_ranks_mean == pytest.approx(whole / 2)
    else:
        assert verl_ranks_mean == pytest.approx(whole)


def _logp(ratios: list[float]) -> tuple[torch.Tensor, torch.Tensor]:
    old = torch.full((1, len(ratios)), -1.0, dtype=torch.float64)
    return old + f64([ratios]).log(), old


def test_vanilla_policy_loss_weights_multiply_after_the_dual_clip() -> None:
    """verl `compute_policy_loss_vanilla`: pg_losses = where(A < 0, min(-A·c, max(pg1, pg2)),
    max(pg1, pg2)), then `pg_losses * rollout_is_weights`. A = -1, r = 5, c = 3, weight 0.5:
    min(3, max(5, 1.2)) · 0.5 = 1.5 (weighting before the clip would give min(2.5, 3) = 2.5)."""
    logp, old = _logp([5.0])
    adv = torch.tensor([-1.0], dtype=torch.float64)
    weights = f64([[0.5]])
    loss, stats = ppo_loss(logp, old, adv, torch.ones(1, 1), weights=weights, dual_clip=3.0)
    assert loss.item() == pytest.approx(1.5)
    # pg_clipfrac_lower = gt(max(pg1, pg2), -A·c) · (A < 0) = 1; pg_clipfrac = gt(pg2, pg1) = 0
    assert stats["dual_clip_fraction"].item() == 1.0
    assert stats["clip_fraction"].item() == 0.0


def test_vanilla_policy_loss_clamps_the_log_ratio_before_ratio_and_ppo_kl() -> None:
    """verl `compute_policy_loss_vanilla`: negative_approx_kl = clamp(logp - old, ±20), ratio =
    exp of it, ppo_kl = masked_mean(-negative_approx_kl). Δ = 30 and -30: ratios e^20 and
    e^-20, ppo_kl = (-20 + 20) / 2 = 0. A = 1 on both: pg = [max(-e^20, -1.2), max(-e^-20,
    -0.8)] = [-1.2, -e^-20]; token-mean (-1.2 - e^-20) / 2."""
    old = torch.zeros(1, 2, dtype=torch.float64)
    logp = f64([[30.0, -30.0]])
    loss, stats = ppo_loss(logp, old, torch.ones(1, dtype=torch.float64), torch.ones(1, 2))
    assert loss.item() == pytest.approx((-1.2 - math.exp(-20)) / 2)
    assert stats["approx_kl"].item() == pytest.approx(0.0)
    assert stats["ratio_mean"].item() == pytest.approx((math.exp(20) + math.exp(-20)) / 2)


def test_gspo_policy_loss_hand_values() -> None:
    """verl `compute_policy_loss_gspo`, clip_ratio_low = clip_ratio_high = 0.2. Row 0: token
    log-ratios [0.1, 0.3], s = e^0.2 = 1.2214, A = 1: max(-1.2214, -1.2) = -1.2 on both tokens
    (clipped). Row 1: one token of log-ratio 0.5 (the second is masked), s = e^0.5 = 1.6487,
    A = -1: max(1.6487, 1.2) = 1.6487, no dual clip in GSPO. Aggregated seq-mean-token-mean:
    (-1.2 + 1.6487) / 2; pg_clipfrac = 2 of 3 tokens."""
    old = torch.zeros(2, 2, dtype=torch.float64)
    logp = f64([[0.1, 0.3], [0.5, 7.0]])
    mask = f64([[1, 1], [1, 0]])
    adv = torch.tensor([1.0, -1.0], dtype=torch.float64)
    loss, stats = gspo_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.2)
    assert loss.item() == pytest.approx((-1.2 + math.exp(0.5)) / 2)
    assert stats["clip_fraction"].item() == pytest.approx(2 / 3)
    # ppo_kl = masked_mean(-(logp - old)) over the 3 tokens
    assert stats["approx_kl"].item() == pytest.approx(-(0.1 + 0.3 + 0.5) / 3)


def test_kl_penalty_forward_hand_values() -> None:
    """verl `kl_penalty_forward`: "kl"/"k1" logp - ref; "abs"; "mse"/"k2" ½(logp - ref)²;
    "low_var_kl"/"k3": kl = clamp(ref - logp, ±20), clamp(e^kl - kl - 1, ±10).
    logp = -1, ref = -1.5: 0.5, 0.5, 0.125, e^-0.5 + 0.5 - 1 = 0.106531.
    logp = 0, ref = -30: kl clamped to -20, e^-20 + 20 - 1 ≈ 19, clamped to 10."""
    logp, ref = torch.tensor([-1.0, 0.0]), torch.tensor([-1.5, -30.0])
    assert kl_penalty(logp, ref, "k1")[0].item() == pytest.approx(0.5)
    assert kl_penalty(logp, ref, "abs")[0].item() == pytest.approx(0.5)
    assert kl_penalty(logp, ref, "k2")[0].item() == pytest.approx(0.125)
    k3 = kl_penalty(logp, ref, "k3")
    assert k3[0].item() == pytest.approx(math.exp(-0.5) - 0.5, rel=1e-6)
    assert k3[1].item() == 10.0


def test_grpo_outcome_advantage_hand_values() -> None:
    """verl `compute_grpo_outcome_advantage`: group [1, 0, 1] has mean 2/3 and torch.std
    (unbiased) sqrt(1/3) = 0.57735: (1/3) / (0.57735 + 1e-6) = 0.57735, (-2/3) / ... = -1.15470.
    The lone sample (reward 0.7) gets mean 0, std 1: 0.7 / (1 + 1e-6).
    norm_adv_by_std_in_grpo=False: [1/3, -2/3, 1/3] and 0.7."""
    rewards = torch.tensor([1.0, 0.0, 0.7, 1.0], dtype=torch.float64)
    groups = torch.tensor([3, 3, 8, 3])
    std = math.sqrt(1 / 3) + 1e-6
    expected = torch.tensor([1 / 3 / std, -2 / 3 / std, 0.7 / (1 + 1e-6), 1 / 3 / std])
    torch.testing.assert_close(grpo_advantages(rewards, groups), expected.double())
    dr = torch.tensor([1 / 3, -2 / 3, 0.7, 1 / 3], dtype=torch.float64)
    torch.testing.assert_close(grpo_advantages(rewards, groups, norm_by_std=False), dr)


def test_rloo_outcome_advantage_hand_values() -> None:
    """verl `compute_rloo_outcome_advantage`: r·n/(n-1) - mean·n/(n-1); group [1, 2, 3]:
    1.5 - 3 = -1.5, 3 - 3 = 0, 4.5 - 3 = 1.5. A lone sample: `rloo_vectorized` gives
    (c·r - Σ)/(c-1).clamp_min(1)·(c > 1) = 0, which we follow (`rloo` would leave 5)."""
    rewards = torch.tensor([1.0, 2.0, 3.0, 5.0], dtype=torch.float64)
    adv = rloo_advantages(rewards, torch.tensor([0, 0, 0, 1]))
    torch.testing.assert_close(adv, torch.tensor([-1.5, 0.0, 1.5, 0.0], dtype=torch.float64))


def test_rollout_correction_weights_hand_values() -> None:
    """verl `compute_rollout_correction_weights`, rollout_is_threshold = 2. Token level:
    exp(clamp(log r, ±20)) · mask, then clamp(max=2): log r = [0, ln 1.5, ln 3, 30] gives
    [1, 1.5, 2, 2]. Sequence level: exp(clamp(Σ_masked log r, ±20)) on every token, times the
    mask: the last token masked, Σ = ln 4.5, so [2, 2, 2, 0]."""
    behav = torch.zeros(1, 4, dtype=torch.float64)
    prox = f64([[0.0, math.log(1.5), math.log(3.0), 30.0]])
    tok = behaviour_weights(prox, behav, torch.ones(1, 4), cap=2.0)
    torch.testing.assert_close(tok, f64([[1.0, 1.5, 2.0, 2.0]]))
    seq = behaviour_weights(prox, behav, f64([[1, 1, 1, 0]]), level="sequence", cap=2.0)
    torch.testing.assert_close(seq, f64([[2.0, 2.0, 2.0, 0.0]]))


def test_rollout_rejection_mask_token_k1_bounds_minus_log_ratio() -> None:
    """verl `compute_rollout_rejection_mask(rollout_rs="token_k1", rollout_rs_threshold="0.5_4")`:
    token_k1 = -log r is kept in [ln 0.5, ln 4], i.e. r in [1/4, 2]: r = [0.2, 0.3, 1, 1.9, 2.5]
    keeps [0, 1, 1, 1, 0]. Ours: lo = 1/4, hi = 1/0.5. `seq_sum_k1` bounds Σ(-log r) the same
    way: a row with ratios [1.5, 1.5] has product 2.25 > 2 and is rejected whole."""
    behav = torch.zeros(1, 5, dtype=torch.float64)
    prox = f64([[0.2, 0.3, 1.0, 1.9, 2.5]]).log()
    keep = behaviour_mask_weights(prox, behav, torch.ones(1, 5), lo=1 / 4, hi=1 / 0.5)
    torch.testing.assert_close(keep, f64([[0, 1, 1, 1, 0]]))
    rows = f64([[1.5, 1.5], [1.2, 1.1]]).log()
    seq = behaviour_mask_weights(
        rows, torch.zeros(2, 2, dtype=torch.float64), torch.ones(2, 2), level="sequence", lo=0.25
    )
    torch.testing.assert_close(seq, f64([[0, 0], [1, 1]]))
