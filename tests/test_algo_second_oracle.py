"""A second oracle, written by other people: expected values published in SkyRL's unit tests.

Source: NovaSky-AI/SkyRL at commit a9564572 (github.com/NovaSky-AI/SkyRL). Each test names the
SkyRL file and test whose setup (inputs) and expected numbers it ports; only those facts are
taken, not code. Where SkyRL's name for a thing differs from ours, the test says which of ours
it is. Files:

- PPO_UTILS = tests/backends/skyrl_train/utils/test_ppo_utils.py
- LOSSES = tests/train/algorithms/test_losses.py
- OPC = tests/train/algorithms/test_off_policy_correction.py

SkyRL bakes the loss reduction into the advantages and then sums (`reduce_loss`); the reduced
value of a loss matrix L is what our `aggregate` returns for it.
"""

from __future__ import annotations

import math

import pytest
import torch

from asyncrl.algo.advantages import grpo_advantages, rloo_advantages
from asyncrl.algo.correction import behaviour_mask_weights, behaviour_weights, weight_stats
from asyncrl.algo.losses import aggregate, kl_penalty, ppo_loss


def tt(rows: list[list[float]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float32)


# --- loss reduction: PPO_UTILS, class TestApplyLossReductionToAdvantagesMinibatch ------------


def test_skyrl_token_mean() -> None:
    """PPO_UTILS test_token_mean: [[1, 2, 3], [4, 5, 6]], mask [[1, 1, 0], [1, 1, 1]] -> 3.6."""
    out = aggregate(tt([[1, 2, 3], [4, 5, 6]]), tt([[1, 1, 0], [1, 1, 1]]), "token-mean")
    assert out.item() == pytest.approx(3.6)


def test_skyrl_token_mean_all_masked() -> None:
    """PPO_UTILS test_token_mean_all_masked: [[1, 2]], mask [[0, 0]] -> 0, not NaN."""
    assert aggregate(tt([[1, 2]]), tt([[0, 0]]), "token-mean").item() == 0.0


def test_skyrl_sequence_mean() -> None:
    """PPO_UTILS test_sequence_mean: [[1, 2], [3, 4]], mask [[1, 1], [1, 0]] -> 2.25. SkyRL's
    sequence_mean is our seq-mean-token-mean."""
    out = aggregate(tt([[1, 2], [3, 4]]), tt([[1, 1], [1, 0]]), "seq-mean-token-mean")
    assert out.item() == pytest.approx(2.25)


def test_skyrl_seq_mean_token_sum_norm_is_our_horizon_mode_not_verls() -> None:
    """PPO_UTILS test_seq_mean_token_sum_norm: [[2, 3], [9, 12]], mask [[1, 1], [1, 0]],
    max_seq_len 10 -> 0.7 ((5/10 + 9/10) / 2). SkyRL's seq_mean_token_sum_norm averages over
    the batch: it is our seq-mean-token-sum-horizon. verl's seq-mean-token-sum-norm, under the
    same name, gives the sum over rows: (5 + 9) / 10 = 1.4."""
    loss, mask = tt([[2, 3], [9, 12]]), tt([[1, 1], [1, 0]])
    skyrl = aggregate(loss, mask, "seq-mean-token-sum-horizon", horizon=10)
    assert skyrl.item() == pytest.approx(0.7)
    verl = aggregate(loss, mask, "seq-mean-token-sum-norm", horizon=10)
    assert verl.item() == pytest.approx(1.4)


# --- policy loss: LOSSES ------------------------------------------------------------------


def test_skyrl_policy_loss_dual_clip() -> None:
    """LOSSES test_policy_loss_dual_clip: A [1, -1, -4], old log-probs [-1, -1, -3], log-probs
    [-1.69315, -1.0, -0.69741] (ratios ≈ 0.5, 1, 10), eps_clip 0.2/0.2, clip_ratio_c 3:
    per-token losses [-0.5, 1.0, 12.0], summed 12.5 (SkyRL's loss is the masked sum: our
    seq-mean-token-sum on one row)."""
    adv = tt([[1.0, -1.0, -4.0]])
    old = tt([[-1.0, -1.0, -3.0]])
    logp = tt([[-1.69315, -1.0, -0.69741]])
    loss, stats = ppo_loss(
        logp, old, adv, torch.ones(1, 3), dual_clip=3.0, agg="seq-mean-token-sum"
    )
    assert loss.item() == pytest.approx(12.5, abs=1e-4)
    per_token = ppo_loss(logp, old, adv, torch.ones(1, 3), dual_clip=3.0, agg="token-mean")[0]
    assert per_token.item() == pytest.approx(12.5 / 3, abs=1e-4)
    assert stats["dual_clip_fraction"].item() == pytest.approx(1 / 3)  # only the A = -4 token


# --- KL and advantages: PPO_UTILS ----------------------------------------------------------


def test_skyrl_compute_approx_kl() -> None:
    """PPO_UTILS test_compute_approx_kl: log-probs [0.2, 0.3, 0.5], base [0.1, 0.2, 0.4], the
    last position masked. Expected (on the unmasked positions, diff 0.1): k1 0.1, abs 0.1,
    k2 ½·0.1², k3 exp(-0.1) - 1 + 0.1."""
    logp, ref = torch.tensor([0.2, 0.3]), torch.tensor([0.1, 0.2])
    diff = 0.1
    cases = {
        "k1": diff,
        "abs": diff,
        "k2": 0.5 * diff**2,
        "k3": math.exp(-diff) - 1 + diff,
    }
    for kind, expected in cases.items():
        torch.testing.assert_close(
            kl_penalty(logp, ref, kind), torch.full((2,), expected), atol=1e-4, rtol=0
        )


def test_skyrl_rloo_basic() -> None:
    """PPO_UTILS test_compute_rloo_outcome_advantage_basic: response rewards 6, 3 (group 0),
    9, 12 (group 1), 1 (group 2, alone) -> [3, -3, -3, 3, 0]."""
    adv = rloo_advantages(torch.tensor([6.0, 3.0, 9.0, 12.0, 1.0]), torch.tensor([0, 0, 1, 1, 2]))
    torch.testing.assert_close(adv, torch.tensor([3.0, -3.0, -3.0, 3.0, 0.0]))


def test_skyrl_grpo_norm_std_false() -> None:
    """PPO_UTILS test_compute_grpo_outcome_advantage_norm_std_false: rewards 6, 3 (group 0) and
    9, 12 (group 1), grpo_norm_by_std False -> [1.5, -1.5, -1.5, 1.5] (our drgrpo)."""
    adv = grpo_advantages(
        torch.tensor([6.0, 3.0, 9.0, 12.0]), torch.tensor([0, 0, 1, 1]), norm_by_std=False
    )
    torch.testing.assert_close(adv, torch.tensor([1.5, -1.5, -1.5, 1.5]))


# --- off-policy correction: OPC (SkyRL's old_log_probs = our π_prox, rollout = π_behav) ----

OLD = tt([[-1.0, -1.5, -0.5]])
ROLLOUT = tt([[-1.5, -1.0, -1.5]])  # token log ratios [0.5, -0.5, 1.0]


def test_skyrl_tis_token_level() -> None:
    """OPC test_compute_tis_ratio_token_level: cap 2 -> [1.6487, 0.6065, 2.0], one token in
    three capped (tis_token_clip_high_ratio 1/3)."""
    mask = torch.ones(1, 3)
    w = behaviour_weights(OLD, ROLLOUT, mask, cap=2.0)
    torch.testing.assert_close(w, tt([[1.6487, 0.6065, 2.0]]), rtol=1e-3, atol=1e-4)
    assert weight_stats(w, mask, cap=2.0)["capped_fraction"].item() == pytest.approx(1 / 3)


def test_skyrl_tis_sequence_level() -> None:
    """OPC test_compute_tis_ratio_sequence_level: Σ log ratio 1.0, cap 5 -> 2.7183 (SkyRL
    returns one value per row; we put it on every token)."""
    w = behaviour_weights(OLD, ROLLOUT, torch.ones(1, 3), level="sequence", cap=5.0)
    torch.testing.assert_close(w, torch.full((1, 3), 2.7183), rtol=1e-3, atol=1e-4)


def test_skyrl_tis_sequence_level_with_cap() -> None:
    """OPC test_compute_tis_ratio_sequence_level_with_cap: old [-1] * 3, rollout [-2] * 3,
    exp(3) = 20.09 capped at 5 -> 5.0."""
    w = behaviour_weights(
        tt([[-1.0] * 3]), tt([[-2.0] * 3]), torch.ones(1, 3), level="sequence", cap=5.0
    )
    torch.testing.assert_close(w, torch.full((1, 3), 5.0))


def test_skyrl_tis_sequence_level_with_mask() -> None:
    """OPC test_compute_tis_ratio_with_mask: mask [1, 0, 1], Σ log ratio 0.5 + 1.0, cap 10 ->
    exp(1.5) = 4.4817 (on the unmasked tokens; the masked one gets 0 here)."""
    w = behaviour_weights(OLD, ROLLOUT, tt([[1, 0, 1]]), level="sequence", cap=10.0)
    torch.testing.assert_close(w, tt([[4.4817, 0.0, 4.4817]]), rtol=1e-3, atol=1e-4)


def test_skyrl_product_sequence_mask() -> None:
    """OPC test_compute_sequence_mask_product and ..._rejects_by_seq_ratio, bounds [0.5, 2]:
    old [-1, -1.1, -1.2] vs rollout [-1.2] * 3 (product e^0.3 ≈ 1.35) is kept; old [-1] * 3 vs
    rollout [-2] * 3 (product e^3 ≈ 20.09) is rejected. SkyRL's product mask is our
    sequence-level masking."""
    kept = behaviour_mask_weights(
        tt([[-1.0, -1.1, -1.2]]), tt([[-1.2] * 3]), torch.ones(1, 3), level="sequence"
    )
    torch.testing.assert_close(kept, torch.ones(1, 3))
    dropped = behaviour_mask_weights(
        tt([[-1.0] * 3]), tt([[-2.0] * 3]), torch.ones(1, 3), level="sequence"
    )
    torch.testing.assert_close(dropped, torch.zeros(1, 3))


def test_skyrl_token_mask_multi_sequence_batch() -> None:
    """OPC test_compute_token_mask_multi_sequence_batch, bounds [0.5, 2]: old [[-1, -1],
    [-3, -1]], rollout [[-1, -3], [-1, -1]] (ratios [[1, e^2], [e^-2, 1]]) -> [[1, 0], [0, 1]],
    half the tokens masked."""
    keep = behaviour_mask_weights(
        tt([[-1.0, -1.0], [-3.0, -1.0]]), tt([[-1.0, -3.0], [-1.0, -1.0]]), torch.ones(2, 2)
    )
    torch.testing.assert_close(keep, tt([[1, 0], [0, 1]]))
    assert weight_stats(keep, torch.ones(2, 2))["dropped_fraction"].item() == 0.5


def test_skyrl_token_mask_boundary_values_are_kept() -> None:
    """OPC test_compute_token_mask_boundary_values: ratios exactly 0.5 and 2.0 (old [0, 0],
    rollout -log [0.5, 2]) are kept (>= low, <= high)."""
    rollout = -torch.log(tt([[0.5, 2.0]]))
    keep = behaviour_mask_weights(torch.zeros(1, 2), rollout, torch.ones(1, 2), lo=0.5, hi=2.0)
    torch.testing.assert_close(keep, torch.ones(1, 2))


def test_skyrl_token_mask_ignores_already_masked_tokens() -> None:
    """OPC test_compute_token_mask_ignores_already_masked_tokens: old [-1] * 3, rollout [-1, -1,
    -6] (ratios 1, 1, 148.4), loss mask [1, 1, 0]: nothing valid is masked. SkyRL's token mask
    holds 1 on the already-masked token and is multiplied into the loss mask; ours holds the
    product already: both make the new loss mask [1, 1, 0]."""
    keep = behaviour_mask_weights(tt([[-1.0] * 3]), tt([[-1.0, -1.0, -6.0]]), tt([[1, 1, 0]]))
    torch.testing.assert_close(keep, tt([[1, 1, 0]]))
