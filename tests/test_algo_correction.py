import math

import pytest
import torch

from asyncrl.algo.correction import behaviour_mask_weights, behaviour_weights, weight_stats

LN = math.log


def _pair(ratios: list[list[float]]) -> tuple[torch.Tensor, torch.Tensor]:
    behav = torch.full((len(ratios), len(ratios[0])), -2.0, dtype=torch.float64)
    prox = behav + torch.tensor(ratios, dtype=torch.float64).log()
    return prox.requires_grad_(), behav


def test_token_level_truncation_and_masking() -> None:
    prox, behav = _pair([[1.0, 1.5, 3.0, 50.0], [0.25, 1.0, 1.0, 1.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    w = behaviour_weights(prox, behav, mask, cap=2.0)
    expected = torch.tensor([[1.0, 1.5, 2.0, 0.0], [0.25, 1.0, 0.0, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(w, expected)
    assert not w.requires_grad


def test_sequence_level_uses_product_of_row_ratios() -> None:
    prox, behav = _pair([[1.0, 1.5, 3.0, 1e6], [0.5, 1.2, 1.0, 1.0], [0.5, 0.5, 0.5, 1.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 1, 0]])
    w = behaviour_weights(prox, behav, mask, level="sequence", cap=2.0)
    # row products 4.5 (capped to 2; the masked 1e6 is ignored), 0.6, 0.125
    expected = torch.tensor(
        [[2.0] * 3 + [0.0], [0.6] * 4, [0.125] * 3 + [0.0]], dtype=torch.float64
    )
    torch.testing.assert_close(w, expected)
    assert not w.requires_grad


def test_extreme_log_ratios_stay_finite() -> None:
    prox = torch.tensor([[0.0, 0.0]])
    behav = torch.tensor([[-1000.0, 1000.0]])
    w = behaviour_weights(prox, behav, torch.ones(1, 2), cap=5.0)
    assert torch.isfinite(w).all()
    torch.testing.assert_close(w, torch.tensor([[5.0, math.exp(-20.0)]]))


def test_mask_weights_drop_out_of_band_tokens() -> None:
    prox, behav = _pair([[1.0, 1.5, 3.0, 0.4], [1.0, 1.9, 0.55, 1.0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]])
    w = behaviour_mask_weights(prox, behav, mask, lo=0.5, hi=2.0)
    expected = torch.tensor([[1.0, 1.0, 0.0, 0.0], [1.0, 1.0, 1.0, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(w, expected)
    assert not w.requires_grad


def test_mask_weights_sequence_level_drops_whole_rows() -> None:
    prox, behav = _pair([[1.5, 1.5, 1.0], [1.2, 1.1, 1.0]])
    w = behaviour_mask_weights(prox, behav, torch.ones(2, 3), level="sequence", lo=0.5, hi=2.0)
    # row products 2.25 (out) and 1.32 (in)
    torch.testing.assert_close(w, torch.tensor([[0.0] * 3, [1.0] * 3], dtype=torch.float64))


def test_bad_arguments() -> None:
    prox, behav = _pair([[1.0]])
    mask = torch.ones(1, 1)
    with pytest.raises(ValueError, match="sequence"):
        behaviour_weights(prox, behav, mask, level="geometric")
    with pytest.raises(ValueError, match="cap"):
        behaviour_weights(prox, behav, mask, cap=0.5)
    with pytest.raises(ValueError, match="lo"):
        behaviour_mask_weights(prox, behav, mask, lo=1.5, hi=2.0)


def test_weight_stats() -> None:
    weights = torch.tensor([[1.0, 2.0, 0.0, 9.0], [0.5, 2.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    stats = weight_stats(weights, mask, cap=2.0)
    assert stats["mean"].item() == pytest.approx(5.5 / 5)
    assert stats["min"].item() == 0.0
    assert stats["max"].item() == 2.0
    assert stats["capped_fraction"].item() == pytest.approx(2 / 5)
    assert stats["dropped_fraction"].item() == pytest.approx(1 / 5)
    assert weight_stats(weights, mask)["capped_fraction"].item() == 0.0


def test_weight_stats_empty_mask_is_all_zero() -> None:
    stats = weight_stats(torch.ones(2, 3), torch.zeros(2, 3), cap=2.0)
    assert all(v.item() == 0.0 for v in stats.values())
