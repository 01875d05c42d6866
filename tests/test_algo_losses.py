import math
import typing

import pytest
import torch

from asyncrl.algo import losses
from asyncrl.algo.config import AlgoConfig
from asyncrl.algo.losses import AGG_MODES, KL_KINDS, aggregate, gspo_loss, kl_penalty, ppo_loss

DOC_L = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
DOC_M = torch.tensor([[1, 1, 0], [0, 0, 0]])


def test_public_names() -> None:
    assert losses.LOSS_NAMES == ("ppo", "gspo")
    assert set(KL_KINDS) == {"k1", "abs", "k2", "k3"}
    assert len(AGG_MODES) == 5
    # the config accepts exactly the modes `aggregate` knows
    assert typing.get_args(AlgoConfig.model_fields["aggregation"].annotation) == AGG_MODES


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("token-mean", 1.5),
        ("seq-mean-token-mean", 1.5),
        ("seq-mean-token-sum", 3.0),
        ("seq-mean-token-sum-norm", 1.0),
        ("seq-mean-token-sum-horizon", 1.0),
    ],
)
def test_aggregate_2x3_with_empty_row(mode: str, expected: float) -> None:
    assert aggregate(DOC_L, DOC_M, mode).item() == pytest.approx(expected)


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("token-mean", 27 / 5),
        ("seq-mean-token-mean", (1.5 + 8) / 2),
        ("seq-mean-token-sum", (3 + 24) / 2),
        # verl's agg_loss: the sum over rows divided by T alone, not by the number of rows
        ("seq-mean-token-sum-norm", (3 + 24) / 3),
        ("seq-mean-token-sum-horizon", (3 / 3 + 24 / 3) / 2),
    ],
)
def test_aggregate_rows_of_different_lengths(mode: str, expected: float) -> None:
    loss_mat = torch.arange(1.0, 10.0).reshape(3, 3)
    mask = torch.tensor([[1, 1, 0], [0, 0, 0], [1, 1, 1]])
    assert aggregate(loss_mat, mask, mode).item() == pytest.approx(expected)
    assert aggregate(loss_mat, mask.bool(), mode).item() == pytest.approx(expected)


@pytest.mark.parametrize("mode", ["seq-mean-token-sum-norm", "seq-mean-token-sum-horizon"])
def test_aggregate_horizon_overrides_width(mode: str) -> None:
    out = aggregate(DOC_L, DOC_M, mode, horizon=6)
    assert out.item() == pytest.approx(0.5)


def test_aggregate_all_masked_is_zero_not_nan() -> None:
    for mode in AGG_MODES:
        out = aggregate(DOC_L, torch.zeros_like(DOC_M), mode)
        assert out.item() == 0.0


def test_aggregate_unknown_mode_names_allowed() -> None:
    with pytest.raises(ValueError, match="seq-mean-token-sum-norm"):
        aggregate(DOC_L, DOC_M, "mean")


def _random_batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    loss_mat = torch.randn(7, 6, generator=g, dtype=torch.float64)
    lengths = torch.tensor([6, 0, 3, 1, 5, 0, 2])
    mask = torch.arange(6) < lengths[:, None]
    return loss_mat, mask


@pytest.mark.parametrize("mode", AGG_MODES)
def test_aggregate_global_normalisers_make_parts_sum_to_whole(mode: str) -> None:
    loss_mat, mask = _random_batch(0)
    whole = aggregate(loss_mat, mask, mode)
    global_tokens = mask.sum().item()
    global_seqs = mask.any(-1).sum().item()
    parts = [
        aggregate(
            loss_mat[rows],
            mask[rows],
            mode,
            global_tokens=global_tokens,
            global_seqs=global_seqs,
        )
        for rows in (slice(0, 3), slice(3, 7))
    ]
    torch.testing.assert_close(parts[0] + parts[1], whole)
    local = [aggregate(loss_mat[r], mask[r], mode) for r in (slice(0, 3), slice(3, 7))]
    if mode == "seq-mean-token-sum-norm":
        # Divided by the common width alone: the parts need no global normaliser.
        torch.testing.assert_close(local[0] + local[1], whole)
    else:
        # Without global normalisers each part normalises by itself and the sum is off.
        assert not torch.allclose(local[0] + local[1], whole)


@pytest.mark.parametrize("mode", ["seq-mean-token-sum-norm", "seq-mean-token-sum-horizon"])
def test_aggregate_horizon_keeps_equivalence_across_padded_widths(mode: str) -> None:
    loss_mat, mask = _random_batch(1)
    whole = aggregate(loss_mat, mask, mode, horizon=6)
    n_seqs = mask.any(-1).sum()
    # the second micro-batch is padded only to its own longest row (5 of 6 columns)
    a = aggregate(loss_mat[:1], mask[:1], mode, global_seqs=n_seqs, horizon=6)
    b = aggregate(loss_mat[1:, :5], mask[1:, :5], mode, global_seqs=n_seqs, horizon=6)
    torch.testing.assert_close(a + b, whole)
    # without the common horizon each micro-batch would divide by its own width
    b_own = aggregate(loss_mat[1:, :5], mask[1:, :5], mode, global_seqs=n_seqs)
    assert not torch.allclose(a + b_own, whole)


def _logp_pair(ratios: list[float]) -> tuple[torch.Tensor, torch.Tensor]:
    old = torch.full((1, len(ratios)), -1.0, dtype=torch.float64)
    logp = old + torch.tensor([ratios], dtype=torch.float64).log()
    return logp, old


def test_ppo_clip_branches_hand_values() -> None:
    # tokens: A>0 ratio above 1+eps (clipped), A<0 ratio below 1-eps (clipped),
    # A<0 with a huge ratio (dual clip), A>0 inside the band, one masked-out outlier
    logp, old = _logp_pair([1.5, 0.5, 5.0, 1.1, 100.0])
    adv = torch.tensor([[1.0, -1.0, -1.0, 1.0, -1.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 1, 0]])
    loss, stats = ppo_loss(logp, old, adv, mask)
    # per token: -1.2, 0.8, min(5, 3) = 3, -1.1
    assert loss.item() == pytest.approx((-1.2 + 0.8 + 3.0 - 1.1) / 4)
    assert stats["clip_fraction"].item() == pytest.approx(2 / 4)
    assert stats["dual_clip_fraction"].item() == pytest.approx(1 / 4)
    assert stats["ratio_mean"].item() == pytest.approx((1.5 + 0.5 + 5.0 + 1.1) / 4)
    expected_kl = -(math.log(1.5) + math.log(0.5) + math.log(5.0) + math.log(1.1)) / 4
    assert stats["approx_kl"].item() == pytest.approx(expected_kl)
    assert all(not v.requires_grad for v in stats.values())

    no_dual, no_dual_stats = ppo_loss(logp, old, adv, mask, dual_clip=None)
    assert no_dual.item() == pytest.approx((-1.2 + 0.8 + 5.0 - 1.1) / 4)
    assert no_dual_stats["dual_clip_fraction"].item() == 0.0


def test_ppo_asymmetric_clip() -> None:
    logp, old = _logp_pair([1.5])
    adv = torch.ones(1, dtype=torch.float64)
    loss, _ = ppo_loss(logp, old, adv, torch.ones(1, 1), clip_high=0.28)
    assert loss.item() == pytest.approx(-1.28)


def test_ppo_gradient_on_policy_is_minus_adv_over_tokens() -> None:
    g = torch.Generator().manual_seed(0)
    logp = (-torch.rand(3, 4, generator=g, dtype=torch.float64)).requires_grad_()
    adv = torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]])
    loss, stats = ppo_loss(logp, logp.detach(), adv, mask)
    loss.backward()
    assert logp.grad is not None
    expected = -adv[:, None] * mask / mask.sum()
    torch.testing.assert_close(logp.grad, expected)
    assert stats["clip_fraction"].item() == 0.0


def test_ppo_token_and_sequence_advantages_agree_and_weights_scale() -> None:
    logp, old = _logp_pair([1.1, 0.95, 1.0])
    mask = torch.ones(1, 3)
    adv_seq = torch.tensor([2.0], dtype=torch.float64)
    a, _ = ppo_loss(logp, old, adv_seq, mask)
    b, _ = ppo_loss(logp, old, adv_seq.expand(1, 3), mask)
    torch.testing.assert_close(a, b)
    weights = torch.tensor([[2.0, 2.0, 2.0]], dtype=torch.float64, requires_grad=True)
    c, _ = ppo_loss(logp, old, adv_seq, mask, weights=weights)
    torch.testing.assert_close(c, 2 * a)
    assert not c.requires_grad  # weights enter as constants: no gradient flows into them


def test_ppo_passes_aggregation_through() -> None:
    logp, old = _logp_pair([1.0, 1.0, 1.0])
    mask = torch.tensor([[1, 1, 0]])
    adv = torch.tensor([1.0], dtype=torch.float64)
    loss, _ = ppo_loss(logp, old, adv, mask, agg="seq-mean-token-sum", global_seqs=4)
    assert loss.item() == pytest.approx(-2 / 4)


def test_ppo_rejects_bad_dual_clip() -> None:
    logp, old = _logp_pair([1.0])
    with pytest.raises(ValueError, match="dual_clip"):
        ppo_loss(logp, old, torch.ones(1), torch.ones(1, 1), dual_clip=1.0)


def test_gspo_gradient_is_sequence_ratio_over_length() -> None:
    g = torch.Generator().manual_seed(0)
    logp = (-torch.rand(3, 4, generator=g, dtype=torch.float64)).requires_grad_()
    old = logp.detach() + 0.3 * torch.randn(3, 4, generator=g, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0], [0, 0, 0, 0], [1, 1, 1, 1]])
    adv = torch.tensor([1.5, 9.0, -0.5], dtype=torch.float64)
    loss, _ = gspo_loss(logp, old, adv, mask, clip_low=0.99, clip_high=100.0)
    loss.backward()
    n_tok = mask.sum(-1).clamp(min=1)
    s = (((logp.detach() - old) * mask).sum(-1) / n_tok).exp()
    n_rows = 2  # the empty row does not count
    expected = -adv[:, None] * s[:, None] / (n_tok[:, None] * n_rows) * mask
    assert logp.grad is not None
    torch.testing.assert_close(logp.grad, expected)
    assert loss.item() == pytest.approx((-(adv * s)[[0, 2]]).sum().item() / n_rows)


def test_gspo_clips_whole_sequences() -> None:
    logp = torch.zeros(2, 2, dtype=torch.float64, requires_grad=True)
    # row 0: s = e^0.2, far outside the default band; row 1: on-policy
    old = torch.tensor([[-0.1, -0.3], [0.0, 0.0]], dtype=torch.float64)
    loss, stats = gspo_loss(logp, old, torch.tensor([1.0, 1.0]), torch.ones(2, 2))
    loss.backward()
    assert logp.grad is not None
    assert torch.equal(logp.grad[0], torch.zeros(2, dtype=torch.float64))
    torch.testing.assert_close(logp.grad[1], torch.full((2,), -1 / 4, dtype=torch.float64))
    assert stats["clip_fraction"].item() == pytest.approx(0.5)
    assert stats["ratio_mean"].item() == pytest.approx((math.exp(0.2) + 1) / 2)


def test_gspo_log_ratio_clamped_at_10() -> None:
    logp = torch.zeros(1, 3, dtype=torch.float64, requires_grad=True)
    old = torch.full((1, 3), -15.0, dtype=torch.float64)
    loss, _ = gspo_loss(logp, old, torch.tensor([-1.0]), torch.ones(1, 3))
    assert loss.item() == pytest.approx(math.exp(10.0))
    loss.backward()
    assert logp.grad is not None
    assert torch.equal(logp.grad, torch.zeros(1, 3, dtype=torch.float64))


def test_kl_penalty_hand_values() -> None:
    logp = torch.tensor([-1.0, -2.0])
    ref = torch.tensor([-2.0, -1.0])
    torch.testing.assert_close(kl_penalty(logp, ref, "k1"), torch.tensor([1.0, -1.0]))
    torch.testing.assert_close(kl_penalty(logp, ref, "abs"), torch.tensor([1.0, 1.0]))
    torch.testing.assert_close(kl_penalty(logp, ref, "k2"), torch.tensor([0.5, 0.5]))
    k3 = torch.tensor([math.exp(-1.0), math.e - 2.0])
    torch.testing.assert_close(kl_penalty(logp, ref, "k3"), k3)


def test_kl_k3_nonnegative_zero_on_policy_and_clamped() -> None:
    g = torch.Generator().manual_seed(0)
    logp, ref = -5 * torch.rand(2, 100, generator=g)
    assert (kl_penalty(logp, ref, "k3") >= 0).all()
    assert torch.equal(kl_penalty(logp, logp, "k3"), torch.zeros(100))
    assert kl_penalty(torch.tensor([-30.0]), torch.tensor([0.0]), "k3").item() == 10.0


def test_kl_unknown_kind() -> None:
    with pytest.raises(ValueError, match="k3"):
        kl_penalty(torch.zeros(1), torch.zeros(1), "k4")
