"""A bfloat16 rollout engine against the fp32 trainer on the quickstart: where the mismatch sits
and what the behaviour correction does to learning.

    python tools/bench_mismatch.py [--config configs/quickstart.yaml] [--steps 60]
                                   [--out docs/mismatch_bench.png] [KEY=VALUE ...]

Runs `asyncrl launch --role all` four times, one after the other, from the same warmed model and
seed: the builtin engine in float32 with `algo.correction=truncate` (the default), then in
bfloat16 with the correction off (`none`), truncating and masking. Every run audits a quarter
of its samples (`rollout.audit_fraction=0.25`), evaluates every 10 steps and keeps its run
directory under a temporary folder. Printed per run: the audit's lag-0 mean |Δ log p| over all
tokens and split at behaviour probability 0.1, the trainer's mean |Δ| at lag 0 and 1 and its
mean importance ratio, and the held-out accuracy at the end; the last line is JSON with all of
it. The figure holds the eval-accuracy curves side by side and the audit's |Δ| per behaviour-
probability bucket of each run.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

from bench_quickstart import launch_all

from asyncrl.algo.mismatch import PROB_LABELS
from asyncrl.config import load_config
from asyncrl.metrics.jsonl import read_jsonl
from asyncrl.metrics.record import MISMATCH_LOG, EvalRecord, StepRecord
from asyncrl.mismatch_report import combine
from asyncrl.model import ensure_model

RUNS = (
    ("fp32, truncate", "float32", "truncate"),
    ("bf16, no correction", "bfloat16", "none"),
    ("bf16, truncate", "bfloat16", "truncate"),
    ("bf16, mask", "bfloat16", "mask"),
)


def _mean(cells: dict[str, dict[str, float]]) -> float | None:
    n = sum(c["tokens"] for c in cells.values())
    return sum(c["abs_diff"] * c["tokens"] for c in cells.values()) / n if n else None


def _split(cells: dict[str, dict[str, float]], low: bool) -> float | None:
    keep = PROB_LABELS[:2] if low else PROB_LABELS[2:]
    return _mean({b: c for b, c in cells.items() if b in keep})


def one_run(cfg_path: str, dtype: str, correction: str, steps: int, extra: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        records = launch_all(
            cfg_path,
            3600,
            f"run.id=bench-mismatch-{dtype}-{correction}",
            f"rollout.engine.dtype={dtype}",
            f"algo.correction={correction}",
            "rollout.audit_fraction=0.25",
            f"trainer.max_steps={steps}",
            "trainer.eval_every=10",
            "metrics.port=0",
            *extra,
            run_dir=run_dir,
        )
        lines = read_jsonl(run_dir / MISMATCH_LOG)
    audit = combine(lines, "audit", "by_prob").get("0", {})
    trained = combine(lines, "trained", "by_prob")
    ratios = [r.mismatch_ratio_mean for r in records if isinstance(r, StepRecord)]
    evals = [(r.step, r.eval_accuracy) for r in records if isinstance(r, EvalRecord)]
    return {
        "audit_tokens": int(sum(c["tokens"] for c in audit.values())),
        "audit_abs_diff": _mean(audit),
        "audit_abs_diff_low_prob": _split(audit, low=True),
        "audit_abs_diff_high_prob": _split(audit, low=False),
        "audit_by_prob": {b: c["abs_diff"] for b, c in audit.items()},
        "trained_abs_diff_lag0": _mean(trained.get("0", {})),
        "trained_abs_diff_lag1": _mean(trained.get("1", {})),
        "ratio_mean": sum(r for r in ratios if r is not None) / max(len(ratios), 1),
        "evals": evals,
        "final_accuracy": evals[-1][1] if evals else None,
    }


def plot(results: dict[str, dict[str, Any]], target: Path) -> None:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 4), layout="constrained")
    left, right = fig.subplots(1, 2)
    for label, r in results.items():
        left.plot(*zip(*r["evals"], strict=True), marker=".", label=label)
        xs = [i for i, b in enumerate(PROB_LABELS) if b in r["audit_by_prob"]]
        right.plot(xs, [r["audit_by_prob"][PROB_LABELS[i]] for i in xs], marker="o", label=label)
    left.set(xlabel="step", ylabel="held-out accuracy", title="learning")
    right.set_xticks(range(len(PROB_LABELS)), PROB_LABELS)
    right.set(xlabel="behaviour probability", ylabel="audit mean |Δ log p| (lag 0)", yscale="log")
    right.set_title("where the engine mismatch sits")
    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.legend()
    target.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(target, dpi=100)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="configs/quickstart.yaml")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--out", default="docs/mismatch_bench.png")
    ap.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    args = ap.parse_args()
    ensure_model(load_config(args.config))
    results = {}
    for label, dtype, correction in RUNS:
        r = one_run(args.config, dtype, correction, args.steps, args.overrides)
        results[label] = r
        fmt = lambda v: "-" if v is None else f"{v:.2e}"  # noqa: E731
        print(
            f"{label:>20}: audit |Δ| {fmt(r['audit_abs_diff'])} over {r['audit_tokens']} tokens "
            f"(p<0.1 {fmt(r['audit_abs_diff_low_prob'])}, p≥0.1 "
            f"{fmt(r['audit_abs_diff_high_prob'])}); trained |Δ| lag 0 "
            f"{fmt(r['trained_abs_diff_lag0'])}, lag 1 {fmt(r['trained_abs_diff_lag1'])}; "
            f"ratio {r['ratio_mean']:.4f}; final accuracy {r['final_accuracy']}",
            flush=True,
        )
    plot(results, Path(args.out))
    print(args.out)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
