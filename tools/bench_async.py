"""Async against sync on the agentic workload: same config, resources and trainer steps.

    python tools/bench_async.py [--config configs/agentic.yaml] [--seeds N] [--first-seed K]
                                [--only MODE] [--tool {inproc,served,both}] [KEY=VALUE ...]

Runs `asyncrl launch --role all` in `run.mode=sync` (rollouts wait for the newest weights,
η = 0) and in async mode (the config's η), one run after the other on the same machine, against
one Redis started here; with `--seeds N` each mode runs N times (`run.seed` K … K + N − 1 with
K = `--first-seed`, default 0; modes alternating), with `--only` one mode alone. Overrides apply
to every run. Times are the trainer's `wall_seconds` at its last step (process start-up before
the trainer's clock and the drain after it are excluded on both sides). A probe consumer group
on each run's trajectories stream, which never acks, keeps every published group readable
afterwards, so group durations can be measured.

Figures (the last line is JSON with them):

- `sync_s`, `async_s`: wall seconds to the last step; `speedup` = sync_s / async_s.
- `trainer_idle_fraction_*`: Σ wait_seconds / wall seconds, every step included (the first
  step's wait is the pipeline fill: worker start-up and the first groups). The extra
  `trainer_idle_fraction_async_after_fill` leaves the fill out: waits of steps 2..S over the
  wall time from the start of step 1's training.
- `final_reward_*`: the final policy's mean reward on the held-out episodes (`task.eval_size`
  of them, `rollout.n` samples each, the training sampling, tools answering at once), from the
  run's last checkpoint. `train_reward_last_quarter_*`: mean `reward_mean` of the training
  batches of the last quarter of the steps (at least 3); in async mode those batches come from
  policies up to η versions old, so that figure trails the policy's own.
- `weight_publish_blocking_fraction_*`: Σ weight_publish_blocking_seconds / Σ step_seconds.
- Over several seeds the timings are medians; `final_reward_*` is the mean, `final_reward_sd_*`
  the standard deviation over seeds, `final_reward_gap` = async − sync and
  `final_reward_gap_se` its standard error, √((sd_sync² + sd_async²) / N): "equal within noise"
  means |gap| ≤ 2 × gap_se.
- `ideal_async_s`: the perfect-overlap bound of the async run, from its own measurements:

      ideal = fill + max(busy, S × G × W / C)

  fill = the async trainer's wait before its first step; busy = async_s − Σ wait_seconds (the
  trainer's own work: steps, weight publishing, checkpoints); S × G = groups trained; W = mean
  duration of a published group (created_at → finished_at, all groups of the run); C = the most
  groups the rollout pool held in flight at once, from the same intervals. By Little's law the
  pool produces at most C / W groups per second, so S × G × W / C is the generation time the
  steps need at the pool's measured capacity. `overlap_efficiency` = ideal_async_s / async_s.

`--tool served` puts the agentic task's tool behind `asyncrl env-server` (one server process
started here, `task.environment.type: remote`), `--tool both` runs each mode with the tool in
the worker and behind the server, side by side (figures suffixed `_served`). For the served
tool, `http_hop_s` is the mean round trip of one call through the server with a tool that
answers at once (create, step, close; measured here, after the runs, on the same machine),
and `http_hop_share` = (turns + 2) × http_hop_s / mean group time: the share of an episode
the HTTP hop costs (a group's n episodes run at once, so its time is about its slowest
episode's: per mean episode the share is somewhat higher).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import redis
from bench_quickstart import launch_all
from transformers import AutoModelForCausalLM, AutoTokenizer

from asyncrl.config import Config, load_config
from asyncrl.engines.torch_engine import TorchEngine
from asyncrl.environments.server import spawn
from asyncrl.evaluate import held_out_reward
from asyncrl.items import PromptItem
from asyncrl.launch.redis_server import RedisServer
from asyncrl.metrics.record import StepRecord
from asyncrl.model import ensure_model
from asyncrl.protocol import decode_group
from asyncrl.runstate import Counter, Keys, read_counters
from asyncrl.tasks.build import build_task
from asyncrl.trainer.checkpoint import list_checkpoints

PROBE = "bench-probe"
MODES = ("sync", "async")
TOOL = "asyncrl.tasks.agentic:ArithmeticToolEnvironment"
HOP_CALLS = 200


def start_env_server(cfg: Config, latency: bool = True) -> tuple[subprocess.Popen[str], str]:
    """`asyncrl env-server` serving the agentic tool with the task's latency; (process, URL)."""
    task = cfg.task
    kwargs = {"observation_prefix": "<bos>"}
    if latency:
        kwargs |= {
            "latency_median_s": getattr(task, "tool_latency_median_s", 0.0),
            "latency_sigma": getattr(task, "tool_latency_sigma", 0.0),
        }
    return spawn(
        TOOL,
        "--kwargs",
        json.dumps(kwargs),
        "--max-sessions",
        "100000",
        environ={**os.environ, "OMP_NUM_THREADS": "1"},
    )


def http_hop_s(cfg: Config) -> float:
    """Mean seconds of one call through an env-server whose tool answers at once."""
    from asyncrl.environments.client import RemotePool
    from asyncrl.environments.config import RemoteEnvironmentConfig
    from asyncrl.items import PromptItem

    proc, url = start_env_server(cfg, latency=False)
    item = PromptItem("12+34;56+78", "12+34=", [1], "12+34=46;56+78=134")
    pool = RemotePool(RemoteEnvironmentConfig(urls=[url]))

    async def calls() -> float:
        t0 = time.perf_counter()
        for _ in range(HOP_CALLS):
            env = pool.environment()
            await env.reset(item)
            await env.step("46")
            await env.close()
        return (time.perf_counter() - t0) / (3 * HOP_CALLS)

    try:
        return asyncio.run(calls())
    finally:
        proc.kill()
        proc.wait()


def run_mode(
    client: redis.Redis,
    url: str,
    cfg_path: str,
    mode: str,
    overrides: list[str],
    tmp: Path,
    seed: int = 0,
    served: bool = False,
    label: str | None = None,
) -> dict[str, Any]:
    """One run; its seed, step lines, the (created, finished) interval of every published group,
    the run's counters and its final policy's held-out reward. `served`: the tool behind an
    env-server; `label`: the run's name in its id (default: `mode`)."""
    keys = Keys(f"bench-async-{label or mode}-{seed}{'-served' if served else ''}")
    client.xgroup_create(keys.trajectories, PROBE, id="0", mkstream=True)
    run_dir = tmp / keys.run_id
    overrides = [*overrides, f"run.seed={seed}"]
    server = None
    if served:
        served_cfg = load_config(cfg_path, overrides)
        server, env_url = start_env_server(served_cfg)
        # Each worker's episodes spend most of their time in the tool: room for all their calls.
        rollout = served_cfg.rollout
        calls = rollout.max_inflight_episodes or rollout.prompts_per_batch * rollout.n
        overrides.append(
            f'task.environment={{type: remote, urls: ["{env_url}"], '
            f"max_sessions_per_server: {calls}}}"
        )
    try:
        lines = launch_all(
            cfg_path,
            1800,
            f"run.id={keys.run_id}",
            f"run.mode={mode}",
            f"redis.url={url}",
            "metrics.port=0",
            *overrides,
            run_dir=run_dir,
        )
    finally:
        if server is not None:
            server.kill()
            server.wait()
    groups = [decode_group(f[b"data"]) for _, f in client.xrange(keys.trajectories)]
    counters = read_counters(client, keys).as_dict()
    # The held-out reward is measured with the tool in process, answering at once.
    cfg = load_config(cfg_path, [o for o in overrides if not o.startswith("task.environment=")])
    return {
        "seed": seed,
        "steps": [r for r in lines if isinstance(r, StepRecord)],
        "intervals": [(g.created_at, g.finished_at) for g in groups],
        "counters": counters,
        "eval_reward": final_reward(cfg, list_checkpoints(run_dir / "checkpoints")[-1]),
        "run_dir": run_dir,
    }


def final_reward(
    cfg: Config, checkpoint: Path, select: Callable[[Any, PromptItem], bool] | None = None
) -> float:
    """Mean reward of `checkpoint`'s policy over the task's held-out episodes, `rollout.n`
    samples each, with the training sampling; the tools answer at once. `select(task, item)`:
    only the held-out episodes it keeps."""
    cfg = cfg.model_copy(
        update={"task": cfg.task.model_copy(update={"tool_latency_median_s": 0.0})}
    )
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    task = build_task(cfg.task, tokenizer)
    model = AutoModelForCausalLM.from_pretrained(checkpoint)
    engine = TorchEngine(model, eos_token_ids=[tokenizer.eos_token_id], seed=cfg.run.seed + 1)
    items = [it for it in task.eval_items() if select is None or select(task, it)]
    reward = held_out_reward(engine, task, tokenizer, items, cfg.rollout.sampling, cfg.rollout.n)
    if reward is None:
        raise RuntimeError(f"no held-out episode of {checkpoint} could be scored")
    return reward


def peak_in_flight(intervals: list[tuple[float, float]]) -> int:
    """Most intervals open at one instant (an end before a start at the same time)."""
    events = sorted([(a, 1) for a, _ in intervals] + [(b, -1) for _, b in intervals])
    peak = now = 0
    for _, delta in events:
        now += delta
        peak = max(peak, now)
    return peak


def summarize(run: dict[str, Any]) -> dict[str, float]:
    steps: list[StepRecord] = run["steps"]

    def total(figure: str, records: list[StepRecord] = steps) -> float:
        return sum(getattr(r, figure) or 0.0 for r in records)

    first = steps[0]
    wall = steps[-1].wall_seconds or 0.0
    waited, stepped = total("wait_seconds"), total("step_seconds")
    last = steps[-max(3, len(steps) // 4) :]
    return {
        "wall_s": wall,
        "fill_s": first.wait_seconds or 0.0,
        "busy_s": wall - waited,
        "idle_fraction": waited / wall,
        "idle_fraction_after_fill": (waited - (first.wait_seconds or 0.0))
        / (wall - (first.wall_seconds or 0.0) + (first.step_seconds or 0.0)),
        "train_reward_last_quarter": total("reward_mean", last) / len(last),
        "final_reward": run["eval_reward"],
        "publish_blocking_fraction": total("weight_publish_blocking_seconds") / stepped,
        "step_seconds_mean": stepped / len(steps),
        "staleness_mean": total("staleness_mean") / len(steps),
        "weight_capped_fraction": total("behaviour_weight_capped_fraction") / len(steps),
    }


def pool_figures(
    run: dict[str, Any], groups_per_step: int, summary: dict[str, float]
) -> dict[str, float]:
    """The perfect-overlap bound of one async run from its own measurements (docstring above)."""
    intervals = run["intervals"]
    mean_group_s = sum(b - t for t, b in intervals) / len(intervals)
    capacity = peak_in_flight(intervals)
    trained = len(run["steps"]) * groups_per_step
    generation_s = trained * mean_group_s / capacity
    ideal = summary["fill_s"] + max(summary["busy_s"], generation_s)
    return {
        "mean_group_s": mean_group_s,
        "peak_groups_in_flight": capacity,
        "generation_s": generation_s,
        Counter.GROUPS_TRAINED: trained,
        "ideal_s": ideal,
        "overlap_efficiency": ideal / summary["wall_s"],
    }


def mode_figures(mode: str, runs: list[dict[str, Any]], groups_per_step: int) -> dict[str, float]:
    """One mode's figures over its seeds: medians of the timings, mean and sd of the reward."""
    summaries = [summarize(r) for r in runs]
    if mode == "async":
        for run, summary in zip(runs, summaries, strict=True):
            summary |= pool_figures(run, groups_per_step, summary)
    for run, summary in zip(runs, summaries, strict=True):
        seed = run["seed"]
        print(f"{mode} seed {seed}: {json.dumps({k: round(v, 4) for k, v in summary.items()})}")
        print(f"{mode} seed {seed} counters: {json.dumps(run['counters'])}")
    out = {k: statistics.median(s[k] for s in summaries) for k in summaries[0]}
    rewards = [s["final_reward"] for s in summaries]
    out["final_reward"] = statistics.fmean(rewards)
    out["final_reward_sd"] = statistics.stdev(rewards) if len(rewards) > 1 else 0.0
    out[Counter.GROUPS_DROPPED_STALE] = statistics.median(
        r["counters"].get(Counter.GROUPS_DROPPED_STALE, 0) for r in runs
    )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="configs/agentic.yaml")
    ap.add_argument(
        "--seeds", type=int, default=1, help="runs per mode, run.seed = K … K + N − 1 (default 1)"
    )
    ap.add_argument(
        "--first-seed", type=int, default=0, metavar="K", help="run.seed of the first run (0)"
    )
    ap.add_argument("--only", choices=MODES, help="run this mode alone and print its figures")
    ap.add_argument(
        "--tool",
        choices=["inproc", "served", "both"],
        default="inproc",
        help="the tool in the worker, behind `asyncrl env-server`, or both side by side",
    )
    ap.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="applied to every run")
    args = ap.parse_args()
    cfg = load_config(args.config, args.overrides)
    ensure_model(cfg)  # built once, before any clock starts
    modes = [args.only] if args.only else list(MODES)
    tools = {"inproc": [False], "served": [True], "both": [False, True]}[args.tool]
    runs: dict[str, list[dict[str, Any]]] = {
        _label(m, served): [] for m in modes for served in tools
    }
    with tempfile.TemporaryDirectory() as tmp:
        server = RedisServer(data_dir=Path(tmp) / "redis").start()
        try:
            client = redis.Redis.from_url(server.url)
            for seed in range(args.first_seed, args.first_seed + args.seeds):
                for mode in modes:
                    for served in tools:
                        runs[_label(mode, served)].append(
                            run_mode(
                                client,
                                server.url,
                                args.config,
                                mode,
                                args.overrides,
                                Path(tmp),
                                seed,
                                served,
                            )
                        )
        finally:
            server.stop()
    for served in tools:
        print(f"--- tool {'behind asyncrl env-server' if served else 'in the worker'}")
        fig = {
            m: mode_figures(m, runs[_label(m, served)], cfg.trainer.groups_per_step) for m in modes
        }
        steps = len(runs[_label(modes[0], served)][0]["steps"])
        report(fig, args.seeds, steps, http_hop_s(cfg) if served else None, cfg)


def _label(mode: str, served: bool) -> str:
    return f"{mode}_served" if served else mode


def report(
    fig: dict[str, dict[str, float]], seeds: int, steps: int, hop_s: float | None, cfg: Config
) -> None:
    """Print one tool setting's figures; the last line is their JSON. `hop_s`: the measured
    HTTP hop of a served tool."""
    if "async" in fig:
        a = fig["async"]
        print(
            f"async pool (medians): mean group {a['mean_group_s']:.2f} s, peak "
            f"{a['peak_groups_in_flight']:.0f} groups in flight, generation needs "
            f"{a['generation_s']:.1f} s for {a[Counter.GROUPS_TRAINED]:.0f} "
            f"groups; trainer busy {a['busy_s']:.1f} s, fill {a['fill_s']:.1f} s"
        )
    both = len(fig) == 2
    result = {f"{m}_s": f["wall_s"] for m, f in fig.items()}
    if both:
        result["speedup"] = fig["sync"]["wall_s"] / fig["async"]["wall_s"]
    if "async" in fig:
        a = fig["async"]
        result |= {"ideal_async_s": a["ideal_s"], "overlap_efficiency": a["overlap_efficiency"]}
    for key, name in (
        ("idle_fraction", "trainer_idle_fraction"),
        ("final_reward", "final_reward"),
        ("final_reward_sd", "final_reward_sd"),
        ("train_reward_last_quarter", "train_reward_last_quarter"),
        ("publish_blocking_fraction", "weight_publish_blocking_fraction"),
    ):
        if key != "final_reward_sd" or seeds > 1:  # one seed has no spread
            result |= {f"{name}_{m}": f[key] for m, f in fig.items()}
    if "async" in fig:
        result |= {
            "trainer_idle_fraction_async_after_fill": fig["async"]["idle_fraction_after_fill"],
            "groups_dropped_stale_async": fig["async"][Counter.GROUPS_DROPPED_STALE],
        }
    if both:
        s, a = fig["sync"], fig["async"]
        result["final_reward_gap"] = a["final_reward"] - s["final_reward"]
        if seeds > 1:
            result["final_reward_gap_se"] = math.sqrt(
                (s["final_reward_sd"] ** 2 + a["final_reward_sd"] ** 2) / seeds
            )
    if hop_s is not None and "async" in fig:
        # An episode makes turns steps, plus its create and close calls.
        calls = getattr(cfg.task, "turns", 1) + 2
        result |= {
            "http_hop_s": hop_s,
            "http_hop_share": calls * hop_s / fig["async"]["mean_group_s"],
        }
    result |= {"seeds": seeds, "steps": steps}
    print(json.dumps({k: round(v, 4) for k, v in result.items()}))


if __name__ == "__main__":
    sys.exit(main())
