"""Async against sync on the agentic workload: same config, resources and trainer steps.

    python tools/bench_async.py [--config configs/agentic.yaml] [KEY=VALUE ...]

Runs `asyncrl launch --role all` twice, one after the other on the same machine, against one
Redis started here: `run.mode=sync` (rollouts wait for the newest weights, η = 0), then async
(the config's η). Overrides apply to both. Times are the trainer's `wall_seconds` at its last
step (process start-up before the trainer's clock and the drain after it are excluded on both
sides). A probe consumer group on each run's trajectories stream, which never acks, keeps every
published group readable afterwards, so group durations can be measured.

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
- `ideal_async_s`: the perfect-overlap bound of the async run, from its own measurements:

      ideal = fill + max(busy, S × G × W / C)

  fill = the async trainer's wait before its first step; busy = async_s − Σ wait_seconds (the
  trainer's own work: steps, weight publishing, checkpoints); S × G = groups trained; W = mean
  duration of a published group (created_at → finished_at, all groups of the run); C = the most
  groups the rollout pool held in flight at once, from the same intervals. By Little's law the
  pool produces at most C / W groups per second, so S × G × W / C is the generation time the
  steps need at the pool's measured capacity. `overlap_efficiency` = ideal_async_s / async_s.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import redis
from bench_quickstart import launch_all
from transformers import AutoModelForCausalLM, AutoTokenizer

from asyncrl.config import Config, load_config
from asyncrl.keys import Keys
from asyncrl.launch.redis_server import RedisServer
from asyncrl.model import ensure_model
from asyncrl.protocol import decode_group
from asyncrl.rollout.episodes import EpisodeScheduler
from asyncrl.rollout.tasks import build_task
from asyncrl.rollout.torch_engine import TorchEngine
from asyncrl.trainer.checkpoint import list_checkpoints

PROBE = "bench-probe"


def run_mode(
    client: redis.Redis, url: str, cfg_path: str, mode: str, overrides: list[str], tmp: Path
) -> dict[str, Any]:
    """One run; its step lines, the (created, finished) interval of every published group, the
    run's counters and its final policy's held-out reward."""
    keys = Keys(f"bench-async-{mode}")
    client.xgroup_create(keys.trajectories, PROBE, id="0", mkstream=True)
    run_dir = tmp / mode
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
    groups = [decode_group(f[b"data"]) for _, f in client.xrange(keys.trajectories)]
    counters = {k.decode(): int(v) for k, v in client.hgetall(keys.counters).items()}  # type: ignore[union-attr]
    cfg = load_config(cfg_path, overrides)
    return {
        "steps": [d for d in lines if "reward_mean" in d],
        "intervals": [(g.created_at, g.finished_at) for g in groups],
        "counters": counters,
        "eval_reward": held_out_reward(cfg, list_checkpoints(run_dir / "checkpoints")[-1]),
    }


def held_out_reward(cfg: Config, checkpoint: Path) -> float:
    """Mean reward of `checkpoint`'s policy over the task's held-out episodes, `rollout.n`
    samples each, with the training sampling; the tools answer at once."""
    cfg = cfg.model_copy(
        update={"task": cfg.task.model_copy(update={"tool_latency_median_s": 0.0})}
    )
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    task = build_task(cfg.task, tokenizer)
    model = AutoModelForCausalLM.from_pretrained(checkpoint)
    engine = TorchEngine(model, eos_token_ids=[tokenizer.eos_token_id], seed=cfg.run.seed + 1)
    episodes: EpisodeScheduler[int] = EpisodeScheduler(
        engine, task, tokenizer, cfg.rollout.sampling
    )
    for i, item in enumerate(task.eval_items()):
        episodes.start(i, item, cfg.rollout.n, f"eval/{i}")
    rewards: list[float] = []
    while episodes.inflight:
        finished, failed = episodes.advance(0.1)
        assert not failed, failed
        rewards += [s.reward for g in finished for s in g.samples]
    episodes.close()
    return sum(rewards) / len(rewards)


def peak_in_flight(intervals: list[tuple[float, float]]) -> int:
    """Most intervals open at one instant (an end before a start at the same time)."""
    events = sorted([(a, 1) for a, _ in intervals] + [(b, -1) for _, b in intervals])
    peak = now = 0
    for _, delta in events:
        now += delta
        peak = max(peak, now)
    return peak


def summarize(run: dict[str, Any]) -> dict[str, float]:
    steps = run["steps"]
    wall = steps[-1]["wall_seconds"]
    waited = sum(s["wait_seconds"] for s in steps)
    stepped = sum(s["step_seconds"] for s in steps)
    last = steps[-max(3, len(steps) // 4) :]
    return {
        "wall_s": wall,
        "fill_s": steps[0]["wait_seconds"],
        "busy_s": wall - waited,
        "idle_fraction": waited / wall,
        "idle_fraction_after_fill": (waited - steps[0]["wait_seconds"])
        / (wall - steps[0]["wall_seconds"] + steps[0]["step_seconds"]),
        "train_reward_last_quarter": sum(s["reward_mean"] for s in last) / len(last),
        "final_reward": run["eval_reward"],
        "publish_blocking_fraction": sum(s["weight_publish_blocking_seconds"] for s in steps)
        / stepped,
        "step_seconds_mean": stepped / len(steps),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="configs/agentic.yaml")
    ap.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="applied to both runs")
    args = ap.parse_args()
    cfg = load_config(args.config, args.overrides)
    ensure_model(cfg)  # built once, before either clock starts
    with tempfile.TemporaryDirectory() as tmp:
        server = RedisServer(data_dir=Path(tmp) / "redis").start()
        try:
            client = redis.Redis.from_url(server.url)
            runs = [
                run_mode(client, server.url, args.config, mode, args.overrides, Path(tmp))
                for mode in ("sync", "async")
            ]
        finally:
            server.stop()
    sync, async_ = runs
    s, a = summarize(sync), summarize(async_)
    intervals = async_["intervals"]
    mean_group_s = sum(b - t for t, b in intervals) / len(intervals)
    capacity = peak_in_flight(intervals)
    trained = len(async_["steps"]) * cfg.trainer.groups_per_step
    generation_s = trained * mean_group_s / capacity
    ideal = a["fill_s"] + max(a["busy_s"], generation_s)
    for name, run, summary in (("sync", sync, s), ("async", async_, a)):
        print(f"{name}: {json.dumps({k: round(v, 4) for k, v in summary.items()})}")
        print(f"{name} counters: {json.dumps(run['counters'])}")
    print(
        f"async pool: mean group {mean_group_s:.2f} s, peak {capacity} groups in flight, "
        f"generation needs {generation_s:.1f} s for {trained} groups; trainer busy "
        f"{a['busy_s']:.1f} s, fill {a['fill_s']:.1f} s"
    )
    print(
        json.dumps(
            {
                "sync_s": round(s["wall_s"], 2),
                "async_s": round(a["wall_s"], 2),
                "speedup": round(s["wall_s"] / a["wall_s"], 2),
                "ideal_async_s": round(ideal, 2),
                "overlap_efficiency": round(ideal / a["wall_s"], 3),
                "trainer_idle_fraction_sync": round(s["idle_fraction"], 3),
                "trainer_idle_fraction_async": round(a["idle_fraction"], 3),
                "final_reward_sync": round(s["final_reward"], 4),
                "final_reward_async": round(a["final_reward"], 4),
                "train_reward_last_quarter_sync": round(s["train_reward_last_quarter"], 4),
                "train_reward_last_quarter_async": round(a["train_reward_last_quarter"], 4),
                "weight_publish_blocking_fraction_sync": round(s["publish_blocking_fraction"], 4),
                "weight_publish_blocking_fraction_async": round(a["publish_blocking_fraction"], 4),
                "trainer_idle_fraction_async_after_fill": round(a["idle_fraction_after_fill"], 3),
                "groups_dropped_stale_async": async_["counters"].get("groups_dropped_stale", 0),
                "steps": len(async_["steps"]),
            }
        )
    )


if __name__ == "__main__":
    sys.exit(main())
