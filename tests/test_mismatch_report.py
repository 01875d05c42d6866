"""`asyncrl mismatch`'s arithmetic: steps add up token-weighted, a resumed step counts once."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from asyncrl.algo.mismatch import mismatch_table, summarise
from asyncrl.metrics.record import MISMATCH_LOG
from asyncrl.mismatch_report import combine, main


def _line(step: int, diffs: list[float]) -> dict:
    n = len(diffs)
    behav = torch.full((n,), -0.05)  # p ≈ 0.95: the top probability bucket
    table = mismatch_table(
        behav + torch.tensor(diffs),
        behav,
        torch.ones(n),
        torch.zeros(n, dtype=torch.long),
        torch.arange(n),
    )
    return {
        "step": step,
        "engine": "torch",
        "engine_dtype": "bfloat16",
        "trainer_dtype": "float32",
        "audit": summarise(table),
        "trained": {},
    }


def test_steps_are_token_weighted_and_a_rewritten_step_counts_once(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    lines = [_line(1, [0.1]), _line(2, [0.4, 0.4, 0.4]), _line(2, [0.2, 0.2, 0.2])]
    cells = combine(lines[:2], "audit", "by_prob")["0"][">=0.9"]
    assert cells["tokens"] == 4
    assert cells["abs_diff"] == pytest.approx((0.1 + 3 * 0.4) / 4)
    assert cells["abs_diff_max"] == pytest.approx(0.4)
    (tmp_path / MISMATCH_LOG).write_text("".join(json.dumps(x) + "\n" for x in lines))
    assert main(tmp_path) == 0
    out = capsys.readouterr().out
    # The second line of step 2 replaced the first: (0.1 + 3 × 0.2) / 4 = 0.175.
    assert "1.75e-01 (4)" in out
    assert "trained: mean |Δ log p| (tokens) by lag × behaviour probability\n  no tokens" in out
    assert (tmp_path / "plots" / "mismatch.png").stat().st_size > 0
