"""The train/inference mismatch report of async quickstart runs (η = 1, so no trained token is
at lag 0): the rollout audit still gives lag-0 figures; with the fp32 builtin engine they are
numerical noise, with a bfloat16 engine clearly larger and concentrated in low-probability
tokens; `asyncrl mismatch RUN_DIR` prints the table and writes its plot."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from asyncrl.algo.mismatch import PROB_LABELS
from asyncrl.metrics.record import MISMATCH_LOG
from asyncrl.mismatch_report import combine

from role_procs import Launched, Run, asyncrl, check_accounting

pytestmark = [pytest.mark.timeout(900), pytest.mark.slow]

STEPS, GROUPS = 6, 16


def _run(launched: Launched, dtype: str) -> Run:
    return launched(
        f"mismatch-{dtype}",
        f"trainer.max_steps={STEPS}",
        f"trainer.groups_per_step={GROUPS}",
        "rollout.n=8",
        "rollout.prompts_per_batch=16",
        "rollout.audit_fraction=0.5",
        f"rollout.engine.dtype={dtype}",
        "algo.max_staleness=1",
    )


@pytest.fixture(scope="module")
def fp32_run(launched: Launched) -> Run:
    return _run(launched, "float32")


@pytest.fixture(scope="module")
def bf16_run(launched: Launched) -> Run:
    return _run(launched, "bfloat16")


def _lines(run: Run) -> list[dict]:
    return [json.loads(line) for line in (run.dir / MISMATCH_LOG).read_text().splitlines()]


def test_fp32_engine_audit_is_noise(fp32_run: Run) -> None:
    steps = fp32_run.steps
    audited = [s for s in steps if "audit_logprob_abs_diff" in s]
    assert audited, "no step carried audit figures"
    for s in audited:
        assert s["audit_tokens"] > 0
        assert s["audit_logprob_abs_diff"] < 1e-5, s
    # Every trained token has a lag; the combined gap is recorded at every step.
    assert all(s["mismatch_logprob_abs_diff"] is not None for s in steps)
    lines = _lines(fp32_run)
    assert [line["step"] for line in lines] == [s["step"] for s in steps]
    assert lines[-1]["engine_dtype"] == "float32" and lines[-1]["trainer_dtype"] == "float32"
    audit = combine(lines, "audit", "by_prob")
    assert set(audit) == {"0"}  # the audit is lag 0 by construction
    assert sum(c["tokens"] for c in audit["0"].values()) == sum(s["audit_tokens"] for s in audited)
    check_accounting(fp32_run, STEPS, GROUPS)


def test_bf16_engine_gap_is_larger_and_sits_in_low_probability_tokens(
    fp32_run: Run, bf16_run: Run
) -> None:
    def mean(run: Run, key: str) -> float:
        values = [s[key] for s in run.steps if s.get(key) is not None]
        assert values, key
        return sum(values) / len(values)

    bf16 = mean(bf16_run, "audit_logprob_abs_diff")
    assert bf16 > 1e-3
    assert bf16 > 100 * mean(fp32_run, "audit_logprob_abs_diff")
    # Token-weighted over the run (a mean of per-step means weighs a step with a handful of
    # low-probability tokens like one with hundreds): tokens of behaviour probability < 0.1
    # against those ≥ 0.9.
    cells = combine(_lines(bf16_run), "audit", "by_prob")["0"]
    low = [cells[b] for b in PROB_LABELS[:2] if b in cells and cells[b]["tokens"]]
    high = cells[PROB_LABELS[-1]]
    low_diff = sum(c["abs_diff"] * c["tokens"] for c in low) / sum(c["tokens"] for c in low)
    assert low_diff > 2 * high["abs_diff"], cells
    check_accounting(bf16_run, STEPS, GROUPS)


def test_mismatch_command_prints_the_table_and_writes_the_plot(bf16_run: Run) -> None:
    out = asyncrl("mismatch", str(bf16_run.dir), "--out", str(bf16_run.dir / "plots"))
    assert out.returncode == 0, out.stderr
    assert "audit: mean |Δ log p| (tokens) by lag × behaviour probability" in out.stdout
    assert "trained: mean |Δ log p| (tokens) by lag × position" in out.stdout
    assert "engine torch (bfloat16), trainer float32" in out.stdout
    assert (bf16_run.dir / "plots" / "mismatch.png").stat().st_size > 0


def test_mismatch_command_on_a_directory_without_a_report(tmp_path: Path) -> None:
    out = asyncrl("mismatch", str(tmp_path))
    assert out.returncode == 2
    assert "holds no step yet" in out.stderr
