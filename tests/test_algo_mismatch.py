"""The mismatch table (`asyncrl.algo.mismatch`) against hand-worked values."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from asyncrl.algo.mismatch import (
    LAG_LABELS,
    POSITION_LABELS,
    PROB_LABELS,
    MismatchTable,
    audit_table,
    mismatch_table,
    response_positions,
    summarise,
)


def test_labels_name_the_bucket_edges() -> None:
    assert PROB_LABELS == ("<0.01", "0.01-0.1", "0.1-0.5", "0.5-0.9", ">=0.9")
    assert POSITION_LABELS == ("<8", "8-16", "16-32", "32-64", ">=64")
    assert LAG_LABELS == ("0", "1", "2", "3", ">=4")


def test_the_docstring_example() -> None:
    # trainer (-0.1, -3.0) vs behaviour (-0.1, -2.0) at lag 0, positions 0 and 1.
    t = mismatch_table(
        torch.tensor([-0.1, -3.0]),
        torch.tensor([-0.1, -2.0]),
        torch.ones(2),
        torch.zeros(2, dtype=torch.long),
        torch.tensor([0, 1]),
    )
    # e^-2 = 0.135 → bucket 2 ([0.1, 0.5)); e^-0.1 = 0.905 → bucket 4 (≥ 0.9).
    assert t.by_prob[0, 2].tolist() == pytest.approx([1.0, 1.0, math.exp(-1.0), 1.0])
    assert t.by_prob[0, 4].tolist() == pytest.approx([1.0, 0.0, 1.0, 0.0])
    assert float(t.by_prob[1:].abs().sum()) == 0.0
    # Both positions fall in the first position bucket (< 8).
    assert t.by_position[0, 0].tolist() == pytest.approx([2.0, 1.0, 1.0 + math.exp(-1.0), 1.0])
    assert t.tokens == 2
    assert t.abs_diff_mean() == pytest.approx(0.5)
    assert t.abs_diff_mean(low_prob=True) is None  # no token below p = 0.1
    assert t.abs_diff_mean(low_prob=False) == pytest.approx(0.5)
    assert t.ratio_mean() == pytest.approx((1 + math.exp(-1.0)) / 2)


def test_lags_positions_and_the_mask_pick_the_cells() -> None:
    # Behaviour log-probs: p = 0.005 (bucket 0), 0.05 (1), 0.95 (4), and a masked token.
    behav = torch.log(torch.tensor([0.005, 0.05, 0.95, 0.5]))
    trainer = behav + torch.tensor([0.2, -0.1, 0.01, 5.0])
    lag = torch.tensor([0, 1, 7, 0])
    position = torch.tensor([3, 8, 64, 0])
    t = mismatch_table(trainer, behav, torch.tensor([1.0, 1.0, 1.0, 0.0]), lag, position)
    assert t.tokens == 3
    assert t.by_prob[0, 0, :2].tolist() == pytest.approx([1.0, 0.2])
    assert t.by_prob[1, 1, :2].tolist() == pytest.approx([1.0, 0.1])
    assert t.by_prob[4, 4, :2].tolist() == pytest.approx([1.0, 0.01], rel=1e-5)  # lag 7 → ≥ 4
    assert t.by_position[1, 1, 0] == 1 and t.by_position[4, 4, 0] == 1
    assert t.abs_diff_mean(lag=0) == pytest.approx(0.2)
    # Low-probability tokens (p < 0.1) at any lag: 0.2 and 0.1.
    assert t.abs_diff_mean(low_prob=True) == pytest.approx(0.15)


def test_tables_add_and_survive_the_all_reduce_layout() -> None:
    one = mismatch_table(
        torch.tensor([-1.0]),
        torch.tensor([-1.5]),
        torch.ones(1),
        torch.tensor([0]),
        torch.tensor([0]),
    )
    two = mismatch_table(
        torch.tensor([-1.0]),
        torch.tensor([-1.25]),
        torch.ones(1),
        torch.tensor([0]),
        torch.tensor([0]),
    )
    both = MismatchTable.empty()
    both.add(one)
    both.add(two)
    cell = both.by_prob[0, 2]  # p = e^-1.5 and e^-1.25 are both in [0.1, 0.5)
    assert cell.tolist() == pytest.approx([2.0, 0.75, math.exp(0.5) + math.exp(0.25), 0.5])
    again = MismatchTable.from_parts(*both.parts())
    assert torch.equal(again.by_prob, both.by_prob)
    assert torch.equal(again.by_position, both.by_position)


def test_response_positions_count_from_the_first_response_token() -> None:
    on = torch.tensor([[False, True, True, True, False], [False, False, True, True, True]])
    assert response_positions(on).tolist() == [[-1, 0, 1, 2, -1], [-1, -1, 0, 1, 2]]


def test_audit_table_leaves_observation_tokens_out() -> None:
    behav = np.log(np.array([0.5, 1.0, 0.5], np.float32))
    audit = behav + np.array([0.25, 0.0, -0.5], np.float32)
    t = audit_table([(audit, behav, np.array([1, 0, 1], np.uint8)), (audit, behav, None)])
    assert t.tokens == 5
    assert float(t.by_prob[1:].sum()) == 0.0  # lag 0 only
    assert t.abs_diff_mean() == pytest.approx((0.75 + 0.75) / 5)


def test_summarise_gives_means_and_leaves_out_empty_cells() -> None:
    t = mismatch_table(
        torch.tensor([-0.1, float("-inf")]),
        torch.tensor([-0.1, -0.2]),
        torch.ones(2),
        torch.tensor([0, 2]),
        torch.tensor([0, 9]),
    )
    out = summarise(t)
    assert set(out) == {"0", "2"}
    assert out["0"]["by_prob"] == {
        ">=0.9": {"tokens": 1, "abs_diff": 0.0, "ratio": 1.0, "abs_diff_max": 0.0}
    }
    # A token outside the trainer's top-k/top-p: infinite |Δ| (null), ratio 0.
    assert out["2"]["by_position"]["8-16"] == {
        "tokens": 1,
        "abs_diff": None,
        "ratio": 0.0,
        "abs_diff_max": None,
    }
