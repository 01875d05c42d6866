"""`asyncrl mismatch RUN_DIR`: the train/inference mismatch tables of a run, and their plots.

Reads `{run_dir}/mismatch.jsonl` (one line per step, `asyncrl.algo.mismatch.summarise` per
source), adds the steps up (the last `--steps` of them; all by default) and prints, per source —
`audit` (the rollout workers' rescoring: the same weights through the trainer's forward path, lag
0) and `trained` (the trainer's log-probs against the behaviour ones at every lag) — the mean
|Δ log p| and token count per lag × behaviour-probability bucket and per lag × position bucket,
with the mean importance ratio per lag; for a mixture-of-experts model with a recorded routing,
the routing agreement per MoE layer (replay on and off apart). `--out` (default
`RUN_DIR/plots`) gets `mismatch.png`.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np

from asyncrl.algo.mismatch import LAG_LABELS, POSITION_LABELS, PROB_LABELS
from asyncrl.metrics.jsonl import read_jsonl
from asyncrl.metrics.record import MISMATCH_LOG

SOURCES = ("audit", "trained")
AXES = (
    ("by_prob", PROB_LABELS, "behaviour probability"),
    ("by_position", POSITION_LABELS, "position"),
)

Cells = dict[str, dict[str, dict[str, float]]]
"""lag label → bucket label → tokens, abs_diff and ratio (means), abs_diff_max."""


def combine(lines: list[dict[str, Any]], source: str, axis: str) -> Cells:
    """The cells of `source`/`axis` over `lines`, token-weighted (a null mean: an infinite one,
    a token outside the trainer's top-k/top-p, stays null)."""
    sums: dict[str, dict[str, dict[str, float]]] = {}
    for line in lines:
        for lag, tables in (line.get(source) or {}).items():
            for bucket, cell in tables.get(axis, {}).items():
                acc = sums.setdefault(lag, {}).setdefault(
                    bucket, {"tokens": 0.0, "abs_diff": 0.0, "ratio": 0.0, "abs_diff_max": 0.0}
                )
                n = cell["tokens"]
                acc["tokens"] += n
                for key in ("abs_diff", "ratio"):
                    value = cell.get(key)
                    acc[key] = float("nan") if value is None else acc[key] + value * n
                top = cell.get("abs_diff_max")
                acc["abs_diff_max"] = float("inf") if top is None else max(acc["abs_diff_max"], top)
    for buckets in sums.values():
        for acc in buckets.values():
            acc["abs_diff"] /= acc["tokens"]
            acc["ratio"] /= acc["tokens"]
    return sums


def render(lines: list[dict[str, Any]]) -> str:
    """The printed report."""
    head = lines[-1]
    out = [
        f"steps {lines[0]['step']}..{head['step']}: engine {head.get('engine')} "
        f"({head.get('engine_dtype')}), trainer {head.get('trainer_dtype')}",
    ]
    for source in SOURCES:
        for axis, labels, title in AXES:
            cells = combine(lines, source, axis)
            out.append("")
            out.append(f"{source}: mean |Δ log p| (tokens) by lag × {title}")
            if not cells:
                out.append("  no tokens")
                continue
            out.append("  " + f"{'lag':>4} " + " ".join(f"{b:>18}" for b in labels))
            for lag in LAG_LABELS:
                if lag not in cells:
                    continue
                row = []
                for b in labels:
                    c = cells[lag].get(b)
                    row.append(f"{c['abs_diff']:.2e} ({int(c['tokens'])})" if c else "-")
                out.append("  " + f"{lag:>4} " + " ".join(f"{r:>18}" for r in row))
        ratios = combine(lines, source, "by_prob")
        for lag in LAG_LABELS:
            if lag in ratios:
                n = sum(c["tokens"] for c in ratios[lag].values())
                r = sum(c["ratio"] * c["tokens"] for c in ratios[lag].values()) / n
                out.append(f"  {source} lag {lag}: mean ratio {r:.6f} over {int(n)} tokens")
    out.extend(render_routing(lines))
    return "\n".join(out)


def render_routing(lines: list[dict[str, Any]]) -> list[str]:
    """Per MoE layer, the token-weighted routing agreement of the steps, replay on and off
    apart: of the experts the trainer's forward used, and of those its router picked."""
    # replay → (tokens, Σ tokens × agreement per layer, the same for the router's picks)
    sums: dict[bool, tuple[float, np.ndarray, np.ndarray]] = {}
    for line in lines:
        routing = line.get("routing")
        if not routing:
            continue
        n = float(routing["tokens"])
        used = n * np.asarray(routing["agreement"], np.float64)
        own = n * np.asarray(routing["router_agreement"], np.float64)
        tokens, used_sum, own_sum = sums.get(bool(routing["replay"]), (0.0, 0.0 * used, 0.0 * own))
        sums[bool(routing["replay"])] = (tokens + n, used_sum + used, own_sum + own)
    out = []
    for replay, (n, used_sum, own_sum) in sorted(sums.items()):
        out.append("")
        out.append(
            f"routing agreement (rollout vs trainer top-k sets), replay {'on' if replay else 'off'}"
            f", {int(n)} tokens"
        )
        out.append("  layer       used     router")
        for layer, (used, own) in enumerate(zip(used_sum / n, own_sum / n, strict=True)):
            out.append(f"  {layer:>5} {used:>10.6f} {own:>10.6f}")
    return out


def plot(lines: list[dict[str, Any]], target: Path, title: str) -> None:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 8), layout="constrained")
    axes = fig.subplots(2, 2, squeeze=False)
    for row, source in enumerate(SOURCES):
        for col, (axis, labels, name) in enumerate(AXES):
            ax = axes[row][col]
            cells = combine(lines, source, axis)
            for lag in LAG_LABELS:
                if lag in cells:
                    xs = [i for i, b in enumerate(labels) if b in cells[lag]]
                    ys = [cells[lag][labels[i]]["abs_diff"] for i in xs]
                    ax.plot(xs, ys, marker="o", label=f"lag {lag}")
            ax.set_xticks(range(len(labels)), labels, fontsize=8)
            ax.set_yscale("log")
            ax.set_xlabel(name)
            ax.set_ylabel("mean |Δ log p|")
            ax.set_title(source)
            ax.grid(alpha=0.3)
            if cells:
                ax.legend()
    fig.suptitle(title)
    fig.savefig(target, dpi=100)


def main(run_dir: str | Path, out: str | Path | None = None, steps: int = 0) -> int:
    path = Path(run_dir) / MISMATCH_LOG
    lines = read_jsonl(path) if path.is_file() else []
    if not lines:
        print(f"asyncrl mismatch: {path} holds no step yet", file=sys.stderr)
        return 2
    # A trainer resumed from an older checkpoint writes the steps after it again: the later
    # lines are the surviving lineage.
    by_step = {line["step"]: line for line in lines if isinstance(line.get("step"), int)}
    lines = [by_step[s] for s in sorted(by_step)]
    lines = lines[-steps:] if steps > 0 else lines
    print(render(lines))
    out_dir = Path(out) if out is not None else Path(run_dir) / "plots"
    out_dir.mkdir(parents=True, exist_ok=True)
    target = out_dir / "mismatch.png"
    plot(lines, target, f"{Path(run_dir).name}: train/inference mismatch")
    print(target)
    return 0
