"""Long episodes trained or starved: sync, async dropping stale groups and async training them
(the default), side by side, to target held-out rewards.

    python tools/bench_long.py [--config configs/agentic_long.yaml] [--seeds N] [--first-seed K]
                               [--target R[,R...]] [--arms sync,drop,train] [KEY=VALUE ...]

The workload (`configs/agentic_long.yaml`): agentic episodes whose hard items — the first sum
carries out of the top digit — wait `task.hard_tool_factor` times as long on their tool, so the
long episodes are the hard ones. Arms, run one after the other on the same machine against one
Redis (`bench_async.run_mode`; each seed runs every arm before the next seed):

- `sync`: `run.mode=sync` (η = 0; every step waits for its slowest group);
- `drop`: async, `algo.stale_policy=drop` (groups staler than η dropped by trainer and workers);
- `train`: async, `algo.stale_policy=train` (nothing dropped for staleness; old tokens masked);
  `train@L` sets `algo.max_token_lag=L` (the default is 2η), to compare lag limits, and
  `train~E` sets η = `algo.max_staleness=E` (and a `rollout.max_inflight_episodes` the config
  sets to (E + 1) × groups_per_step × n), to compare staleness windows.

Every run checkpoints each `trainer.checkpoint_every` steps and keeps them all; afterwards each
checkpoint's policy is scored on the held-out episodes (`bench_async.final_reward`: `rollout.n`
samples each, tools answering at once) — the hard class and the rest, the whole their mean
weighted by item counts — at the trainer's `wall_seconds` stored in it. Per arm, over seeds
(mean ± standard error):

- `time_to_R_s` / `time_to_R_hard_s`, for each `--target` R: wall seconds of the first
  checkpoint whose held-out reward (all / hard class) is ≥ R; a run that never reaches it
  counts in `not_reached` and is left out of the mean (a target near where the curve levels off
  measures its noise: name a lower one beside it);
- `reward_at_equal_time` / `reward_hard_at_equal_time`: the held-out reward of the arm's last
  checkpoint at or before T, T = the shortest final wall time among the async arms' runs of
  that seed at the config's η (the drop-vs-train comparison at equal wall time);
- `final_reward`, `final_reward_hard`, `wall_s`;
- `length_bias_ks`: the last step's figure (generated vs trained episode lengths),
  `groups_dropped_stale`, and `tokens_lag_masked_fraction` (mean over steps).

For the async arms it also prints the trained tokens' mean |Δ log p| (trainer − behaviour) by
lag bucket of their response, from the run's `mismatch.jsonl`: how far off-policy a token is at
each staleness, the figure a lag limit trades against the tokens it masks.

The last line is JSON with them, and `speedup_ARM_to_R` = sync / ARM mean time to R for each
async arm.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import tempfile
from pathlib import Path
from typing import Any

import redis
from bench_async import final_reward, run_mode
from transformers import AutoTokenizer

from asyncrl.config import Config, load_config
from asyncrl.launch.redis_server import RedisServer
from asyncrl.metrics.jsonl import read_jsonl
from asyncrl.metrics.record import MISMATCH_LOG
from asyncrl.model import ensure_model
from asyncrl.runstate import Counter
from asyncrl.tasks.build import build_task
from asyncrl.trainer.checkpoint import list_checkpoints, read_state

ARMS: dict[str, tuple[str, list[str]]] = {
    "sync": ("sync", []),
    "drop": ("async", ["algo.stale_policy=drop"]),
    "train": ("async", ["algo.stale_policy=train"]),
}


def arm_settings(arm: str, cfg: Config) -> tuple[str, list[str]]:
    """(run.mode, overrides) of an arm name: a key of `ARMS`, `train@L` or `train~E`, on `cfg`."""
    rest, _, eta = arm.partition("~")
    name, _, lag = rest.partition("@")
    mode, extra = ARMS[name]
    if lag:
        extra = [*extra, f"algo.max_token_lag={int(lag)}"]
    if eta:
        extra = [*extra, f"algo.max_staleness={int(eta)}"]
        if cfg.rollout.max_inflight_episodes is not None:
            episodes = (int(eta) + 1) * cfg.trainer.groups_per_step * cfg.rollout.n
            extra.append(f"rollout.max_inflight_episodes={episodes}")
    return mode, extra


def lag_gap(run_dir: Path) -> dict[str, tuple[int, float]]:
    """Lag bucket → (trained tokens, mean |Δ log p|) over the run's `mismatch.jsonl`."""
    sums: dict[str, list[float]] = {}
    for line in read_jsonl(run_dir / MISMATCH_LOG):
        for lag, table in (line.get("trained") or {}).items():
            for cell in table["by_prob"].values():
                acc = sums.setdefault(lag, [0.0, 0.0])
                acc[0] += cell["tokens"]
                acc[1] += cell["tokens"] * (cell["abs_diff"] or 0.0)
    return {lag: (int(n), d / n) for lag, (n, d) in sums.items() if n}


def _hard(task: Any, item: Any) -> bool:
    return bool(task.is_hard(item))


def _easy(task: Any, item: Any) -> bool:
    return not task.is_hard(item)


def curve(cfg_path: str, overrides: list[str], run_dir: Path) -> list[tuple[float, float, float]]:
    """(wall seconds, held-out reward, hard-class reward) of every checkpoint of a run."""
    cfg = load_config(cfg_path, overrides)
    task = build_task(cfg.task, AutoTokenizer.from_pretrained(cfg.model.path))
    hard_share = statistics.fmean(task.is_hard(it) for it in task.eval_items())
    points = []
    for path in list_checkpoints(run_dir / "checkpoints"):
        wall = read_state(path).wall_seconds
        # Each class scored once and the whole weighted by item counts: the held-out episodes
        # (the run's slowest part on loaded cores) are generated once per checkpoint, not 1.5×.
        hard, easy = final_reward(cfg, path, _hard), final_reward(cfg, path, _easy)
        points.append((wall, hard_share * hard + (1 - hard_share) * easy, hard))
    return points


def first_at(points: list[tuple[float, float, float]], target: float, col: int) -> float | None:
    return next((p[0] for p in points if p[col] >= target), None)


def at_time(points: list[tuple[float, float, float]], t: float, col: int) -> float | None:
    before = [p for p in points if p[0] <= t + 1e-9]
    return before[-1][col] if before else None


def mean_se(values: list[float]) -> tuple[float | None, float | None]:
    if not values:
        return None, None
    se = statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else None
    return statistics.fmean(values), se


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="configs/agentic_long.yaml")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--first-seed", type=int, default=0)
    # 0.8 is where a fresh tiny-model build levels off on the committed config (docs/benchmarks.md):
    # the targets below it are where every run arrives.
    ap.add_argument(
        "--target", default="0.8,0.75,0.7", help="held-out rewards to reach (comma-separated)"
    )
    ap.add_argument(
        "--arms",
        default=",".join(ARMS),
        help="sync, drop, train, train@L, train~E (comma-separated)",
    )
    ap.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="applied to every run")
    args = ap.parse_args()
    arms = args.arms.split(",")
    ensure_model(load_config(args.config, args.overrides))
    per_seed: dict[int, dict[str, dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        server = RedisServer(data_dir=Path(tmp) / "redis").start()
        try:
            client = redis.Redis.from_url(server.url)
            for seed in range(args.first_seed, args.first_seed + args.seeds):
                per_seed[seed] = {}
                for arm in arms:
                    per_seed[seed][arm] = run_arm(client, server.url, args, arm, seed, Path(tmp))
        finally:
            server.stop()
    report(per_seed, arms, [float(t) for t in args.target.split(",")])


def run_arm(
    client: redis.Redis, url: str, args: argparse.Namespace, arm: str, seed: int, tmp: Path
) -> dict[str, Any]:
    """One run of `arm`, with the held-out curve of its checkpoints (and, async, its lag gap)."""
    mode, extra = arm_settings(arm, load_config(args.config, args.overrides))
    overrides = [*args.overrides, *extra]
    label = arm.replace("@", "-lag").replace("~", "-eta")
    run = run_mode(client, url, args.config, mode, overrides, tmp, seed, label=label)
    run["curve"] = curve(args.config, overrides, run["run_dir"])
    print(f"{arm} seed {seed}: curve (s, all, hard) {_rounded(run['curve'])}")
    if mode == "async":
        gaps = {k: (n, round(d, 4)) for k, (n, d) in lag_gap(run["run_dir"]).items()}
        print(f"{arm} seed {seed}: lag → (tokens, mean |Δ log p|) {gaps}")
    return run


def _rounded(points: list[tuple[float, float, float]]) -> list[list[float]]:
    return [[round(x, 3) for x in p] for p in points]


def report(
    per_seed: dict[int, dict[str, dict[str, Any]]], arms: list[str], targets: list[float]
) -> None:
    figures: dict[str, dict[str, Any]] = {arm: {} for arm in arms}
    samples: dict[str, dict[str, list[float]]] = {arm: {} for arm in arms}
    asyncs = [a for a in arms if a.partition("~")[0].partition("@")[0] != "sync"]
    for runs in per_seed.values():
        # Arms of another η end at other times: T is that of the config's η.
        same_eta = [a for a in asyncs if "~" not in a] or asyncs
        equal_t = min((runs[a]["curve"][-1][0] for a in same_eta), default=math.inf)
        for arm in arms:
            run, points = runs[arm], runs[arm]["curve"]
            last = run["steps"][-1]
            values: dict[str, float | None] = {}
            for target in targets:
                values[f"time_to_{target}_s"] = first_at(points, target, 1)
                values[f"time_to_{target}_hard_s"] = first_at(points, target, 2)
            values |= {
                "reward_at_equal_time": at_time(points, equal_t, 1) if asyncs else None,
                "reward_hard_at_equal_time": at_time(points, equal_t, 2) if asyncs else None,
                "final_reward": points[-1][1],
                "final_reward_hard": points[-1][2],
                "wall_s": last.wall_seconds,
                "length_bias_ks": last.length_bias_ks,
                "groups_dropped_stale": run["counters"].get(Counter.GROUPS_DROPPED_STALE, 0),
                "tokens_lag_masked_fraction": statistics.fmean(
                    r.tokens_lag_masked_fraction or 0.0 for r in run["steps"]
                ),
            }
            for name, value in values.items():
                if value is None:
                    figures[arm][f"{name}_not_reached"] = (
                        figures[arm].get(f"{name}_not_reached", 0) + 1
                    )
                else:
                    samples[arm].setdefault(name, []).append(float(value))
    result: dict[str, Any] = {"targets": targets, "seeds": len(per_seed)}
    for arm in arms:
        for name, seen in samples[arm].items():
            mean, se = mean_se(seen)
            figures[arm][name] = mean
            if se is not None:
                figures[arm][f"{name}_se"] = se
        print(f"{arm}: {json.dumps(_round(figures[arm]))}")
        result |= {f"{arm}_{k}": v for k, v in figures[arm].items()}
    for arm in asyncs:
        for target in targets:
            for cls in ("", "_hard"):
                col = f"time_to_{target}{cls}_s"
                s, t = figures.get("sync", {}).get(col), figures[arm].get(col)
                if s is not None and t:
                    result[f"speedup_{arm}_to_{target}{cls}"] = s / t
    print(json.dumps(_round(result)))


def _round(d: dict[str, Any]) -> dict[str, Any]:
    return {k: round(v, 4) if isinstance(v, float) else v for k, v in d.items()}


if __name__ == "__main__":
    main()
