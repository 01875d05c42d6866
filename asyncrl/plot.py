"""`asyncrl plot RUN_DIR`: PNG curves from a run's metrics.jsonl.

Writes, into `--out` (default `RUN_DIR/plots`):
- `reward.png`: reward_mean and eval_accuracy vs step and vs wall_seconds;
- `staleness.png`: staleness mean and max vs step;
- `length_bias.png`: the length-bias KS statistic, and the episode tokens and seconds of the
  groups generated against those trained, vs step;
- `correction.png`: behaviour_weight_mean and clip_fraction vs step;
- `throughput.png`: trainer tokens/s vs step;
- `time.png`: the time breakdown, stacked: the trainer's per step, the rollout workers' (all of
  them, `rollout.jsonl`) per interval of wall time.

Missing keys are tolerated; a figure with no data at all is skipped. Matplotlib is imported
only here, and used through `Figure` (Agg), never pyplot: no display, no global state.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from asyncrl.metrics.breakdown import (
    ROLLOUT_PHASES,
    TRAINER_PHASES,
    TimeSplit,
    mean_split,
    split_of,
)
from asyncrl.metrics.jsonl import read_jsonl
from asyncrl.metrics.record import EvalRecord, StepRecord, read_record, read_worker_log

if TYPE_CHECKING:
    from matplotlib.axes import Axes

R = TypeVar("R", StepRecord, EvalRecord)
Series = tuple[str, list[float], list[float]]
Panel = tuple[list[Series], str, str]  # series, x label, y label


def _latest_per_step(records: list[R]) -> list[R]:
    # A trainer resumed from an older checkpoint rewrites the steps after it; the later lines
    # are the surviving lineage.
    by_step = {r.step: r for r in records}
    return [by_step[s] for s in sorted(by_step)]


def _series(label: str, records: list[R], x: str, y: str | Callable[[R], float | None]) -> Series:
    xs, ys = [], []
    for record in records:
        xv = getattr(record, x)
        yv = y(record) if callable(y) else getattr(record, y)
        if xv is not None and yv is not None and math.isfinite(yv):
            xs.append(float(xv))
            ys.append(float(yv))
    return label, xs, ys


def _draw(ax: Axes, series: list[Series], xlabel: str, ylabel: str) -> bool:
    drawn = False
    for label, xs, ys in series:
        if xs:
            ax.plot(xs, ys, label=label, marker="." if len(xs) < 50 else None)
            drawn = True
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    if drawn:
        ax.legend()
    return drawn


def _figures(steps: list[StepRecord], evals: list[EvalRecord]) -> dict[str, list[Panel]]:
    """Figure name → its panels, side by side."""
    by_wall = sorted(steps, key=lambda r: r.wall_seconds or 0.0)
    evals_by_wall = sorted(evals, key=lambda r: r.wall_seconds or 0.0)
    return {
        "reward": [
            (
                [
                    _series("reward_mean", steps, "step", "reward_mean"),
                    _series("eval_accuracy", evals, "step", "eval_accuracy"),
                ],
                "step",
                "reward / accuracy",
            ),
            (
                [
                    _series("reward_mean", by_wall, "wall_seconds", "reward_mean"),
                    _series("eval_accuracy", evals_by_wall, "wall_seconds", "eval_accuracy"),
                ],
                "wall seconds",
                "reward / accuracy",
            ),
        ],
        "staleness": [
            (
                [
                    _series("staleness_mean", steps, "step", "staleness_mean"),
                    _series("staleness_max", steps, "step", "staleness_max"),
                ],
                "step",
                "staleness (versions)",
            )
        ],
        "length_bias": [
            ([_series("length_bias_ks", steps, "step", "length_bias_ks")], "step", "KS statistic"),
            *(
                (
                    [_series(side, steps, "step", f"episode_{m}_{side}") for side in _SIDES],
                    "step",
                    f"episode {m} (mean)",
                )
                for m in ("tokens", "seconds")
            ),
        ],
        "correction": [
            (
                [_series("behaviour_weight_mean", steps, "step", "behaviour_weight_mean")],
                "step",
                "behaviour weight",
            ),
            ([_series("clip_fraction", steps, "step", "clip_fraction")], "step", "clip fraction"),
        ],
        "throughput": [([_series("tokens/s", steps, "step", _throughput)], "step", "tokens / s")],
    }


_SIDES = ("generated", "trained")


def _throughput(record: StepRecord) -> float | None:
    return record.throughput


def _rollout_splits(run_dir: Path) -> list[tuple[float, TimeSplit]]:
    """All workers' intervals, as one split per `metrics.breakdown_every_s`-long bin of wall time
    (workers report out of step with each other)."""
    records = read_worker_log(run_dir)
    if not records:
        return []
    width = sorted(r.breakdown_seconds for r in records)[len(records) // 2] or 1.0
    bins: dict[int, list[TimeSplit]] = {}
    for r in records:
        split = split_of(r, ROLLOUT_PHASES)
        if split is not None:
            bins.setdefault(round(r.wall_seconds / width), []).append(split)
    merged = [(b * width, mean_split(splits)) for b, splits in sorted(bins.items())]
    return [(x, split) for x, split in merged if split is not None]


def _stacked(
    ax: Axes, points: list[tuple[float, TimeSplit]], phases: tuple[str, ...], x: str
) -> bool:
    if not points:
        return False
    xs = [p[0] for p in points]
    ax.stackplot(xs, *[[s.fractions[ph] for _, s in points] for ph in phases], labels=phases)
    ax.set_xlabel(x)
    ax.set_ylabel("share of wall time")
    ax.set_ylim(0, 1)
    ax.legend(loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize="small")
    return True


def _time_figure(run_dir: Path, steps: list[StepRecord], out_dir: Path) -> None:
    from matplotlib.figure import Figure

    trainer = [(float(r.step), s) for r in steps if (s := split_of(r, TRAINER_PHASES)) is not None]
    fig = Figure(figsize=(13, 4), layout="constrained")
    left, right = fig.subplots(1, 2, squeeze=False)[0]
    drawn = [
        _stacked(left, trainer, TRAINER_PHASES, "step"),
        _stacked(right, _rollout_splits(run_dir), ROLLOUT_PHASES, "rollout wall seconds"),
    ]
    if not any(drawn):
        print("skipped time.png: no data")
        return
    left.set_title("trainer")
    right.set_title("rollout workers")
    fig.suptitle(f"{run_dir.name}: where the time goes")
    target = out_dir / "time.png"
    fig.savefig(target, dpi=100)
    print(target)


def main(run_dir: str | Path, out: str | Path | None = None) -> int:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        print(
            f"asyncrl plot: {path} does not exist (is {run_dir} a run directory?)", file=sys.stderr
        )
        return 2
    records = [r for r in map(read_record, read_jsonl(path)) if r is not None]
    if not records:
        print(f"asyncrl plot: {path} holds no records yet", file=sys.stderr)
        return 2
    from matplotlib.figure import Figure

    steps = _latest_per_step([r for r in records if isinstance(r, StepRecord)])
    evals = _latest_per_step([r for r in records if isinstance(r, EvalRecord)])
    out_dir = Path(out) if out is not None else Path(run_dir) / "plots"
    out_dir.mkdir(parents=True, exist_ok=True)
    for name, panels in _figures(steps, evals).items():
        fig = Figure(figsize=(5.5 * len(panels), 4), layout="constrained")
        axes = fig.subplots(1, len(panels), squeeze=False)[0]
        drawn = [_draw(ax, *panel) for ax, panel in zip(axes, panels, strict=True)]
        if not any(drawn):
            print(f"skipped {name}.png: no data")
            continue
        fig.suptitle(f"{Path(run_dir).name}: {name}")
        target = out_dir / f"{name}.png"
        fig.savefig(target, dpi=100)
        print(target)
    _time_figure(Path(run_dir), steps, out_dir)
    return 0
