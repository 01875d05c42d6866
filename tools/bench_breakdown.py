"""Overhead of the time breakdown (`asyncrl.metrics.breakdown`): on against off, side by side.

    python tools/bench_breakdown.py [--repeats 15] [--threads 2]

Three loops of the quickstart and agentic workloads, in this process on a random tiny model of
the quickstart architecture, each run alternately with a breakdown active on the thread (on; in
the two rollout loops with the Prometheus counters a rollout worker's breakdown adds to as each
phase ends) and none (off: every `phase()` is a thread-local lookup and a shared no-op):

- `trainer_step`: one `train_step` of the quickstart's batch (64 groups × 8 samples, 4 response
  tokens; `trainer.micro_batch_tokens` small enough for several micro-batches);
- `rollout_generate`: one engine call of the quickstart's batch (32 prompts × 8, 4 new tokens);
- `agentic_episodes`: 16 groups × 8 three-turn agentic episodes through the worker's episode
  scheduler, the tool's latency 0 (the loop at its busiest: the most phases per second).

Each figure is the median over --repeats after a warm-up, the two modes alternating which goes
first; the ratio on/off is the overhead (goal ≤ 1.01), also given for the fastest call of each
mode and for the process' CPU time (both less disturbed by other jobs on a shared machine). It
also counts the phases each loop enters and times one enter/leave pair, whose product is the
overhead free of run-to-run noise (a pair with the counters for the rollout loops). The last
line is JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from asyncrl.algo.config import AlgoConfig
from asyncrl.engines.sampling import SamplingParams
from asyncrl.engines.torch_engine import TorchEngine
from asyncrl.metrics import breakdown
from asyncrl.metrics.breakdown import ROLLOUT_PHASES, TRAINER_PHASES, Breakdown, Counts
from asyncrl.metrics.roles import RoleMetrics
from asyncrl.protocol import Sample, TrajectoryGroup
from asyncrl.tiny_model import new_tiny_model, save_random_tiny_model
from asyncrl.trainer.batch import group_rows
from asyncrl.trainer.step import train_step

SAMPLING = SamplingParams(temperature=1.0, max_new_tokens=4)
Counters = Mapping[str, Counts]


def _groups(n_groups: int, n: int, rng: np.random.Generator) -> list[TrajectoryGroup]:
    def sample(s: int) -> Sample:
        return Sample(
            response_ids=rng.integers(3, 15, 4).astype(np.int32),
            logprobs=-rng.uniform(0.5, 3.0, 4).astype(np.float32),
            versions=np.full(4, 3, np.int32),
            reward=float(s % 2),
            finish="length",
        )

    return [
        TrajectoryGroup(
            run="bench",
            group_id=f"{g}-0",
            prompt_id=str(g),
            release_version=3,
            worker="w",
            created_at=0.0,
            finished_at=0.0,
            prompt_ids=np.array([1, *rng.integers(3, 15, 6)], np.int32),
            samples=[sample(s) for s in range(n)],
        )
        for g in range(n_groups)
    ]


def _trainer_step() -> Callable[[], None]:
    model = new_tiny_model(seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    rows = group_rows(_groups(64, 8, np.random.default_rng(0)), AlgoConfig(), 4)

    def run() -> None:
        train_step(
            model,
            optimizer,
            rows,
            algo=AlgoConfig(),
            sampling=SAMPLING,
            micro_batch_tokens=1024,
            grad_clip=1.0,
            current_version=3,
        )

    return run


def _rollout_generate(model_dir: Path) -> Callable[[], None]:
    engine = TorchEngine.from_config(_engine_cfg(), model_path=str(model_dir))
    rng = np.random.default_rng(1)
    prompts = [[1, *rng.integers(3, 15, 6).tolist()] for _ in range(32) for _ in range(8)]
    return lambda: engine.generate(prompts, SAMPLING)  # type: ignore[return-value]


def _engine_cfg(**kw: Any) -> Any:
    from asyncrl.engines.config import TorchEngineConfig

    return TorchEngineConfig(**kw)


def _agentic_episodes(model_dir: Path) -> Callable[[], None]:
    from transformers import AutoTokenizer

    from asyncrl.rollout.scheduler import EpisodeScheduler
    from asyncrl.tasks.build import build_task
    from asyncrl.tasks.config import AgenticTaskConfig

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    task = build_task(
        AgenticTaskConfig(type="agentic", digits=2, turns=3, tool_latency_median_s=0.0),
        tokenizer,
    )
    engine = TorchEngine.from_config(
        _engine_cfg(max_batch_size=2048, prefix_cache_tokens=200000, prefix_cache_stale=True),
        model_path=str(model_dir),
    )
    items = list(task.train_items(0, 0))[:16]
    scheduler: EpisodeScheduler[int] = EpisodeScheduler(engine, task, tokenizer, SAMPLING)

    def run() -> None:
        for i, item in enumerate(items):
            scheduler.start(i, item, 8, f"e{i}")
        done = 0
        while done < len(items):
            finished, failed = scheduler.advance(0.05)
            done += len(finished) + len(failed)

    return run


class _Counting(Breakdown):
    """A breakdown that counts the phases entered (for the per-call estimate)."""

    entered = 0

    def enter(self, name: str) -> None:
        _Counting.entered += 1
        super().enter(name)


def _pair_seconds(counters: Counters | None, n: int = 200_000) -> float:
    b = Breakdown(ROLLOUT_PHASES, counters).activate()
    start = time.perf_counter()
    for _ in range(n):
        with breakdown.phase("decode"):
            pass
    on = (time.perf_counter() - start) / n
    breakdown.deactivate()
    del b
    return on


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model_dir = save_random_tiny_model(Path(tempfile.mkdtemp()) / "tiny", seed=0)
    counters = RoleMetrics("rollout", "bench").breakdown_seconds
    loops: dict[str, tuple[Callable[[], None], tuple[str, ...], Counters | None]] = {
        "trainer_step": (_trainer_step(), TRAINER_PHASES, None),
        "rollout_generate": (_rollout_generate(model_dir), ROLLOUT_PHASES, counters),
        "agentic_episodes": (_agentic_episodes(model_dir), ROLLOUT_PHASES, counters),
    }
    pairs = {False: _pair_seconds(None), True: _pair_seconds(counters)}
    results: dict[str, Any] = {
        "phase_pair_us": round(pairs[False] * 1e6, 3),
        "phase_pair_counted_us": round(pairs[True] * 1e6, 3),
    }
    for name, (run, phases, counted) in loops.items():
        pair = pairs[counted is not None]
        run()  # warm-up
        _Counting.entered = 0
        _Counting(phases, counted).activate()
        run()
        calls = _Counting.entered
        times: dict[str, list[float]] = {"on": [], "off": []}
        cpu: dict[str, list[float]] = {"on": [], "off": []}
        for i in range(args.repeats):
            # Alternating which goes first: a call that pays for its predecessor's leftovers
            # (garbage, a closing environment) does so in both modes alike.
            for mode in ("on", "off") if i % 2 else ("off", "on"):
                if mode == "on":
                    Breakdown(phases, counted).activate()
                else:
                    breakdown.deactivate()
                start, start_cpu = time.perf_counter(), time.process_time()
                run()
                times[mode].append(time.perf_counter() - start)
                cpu[mode].append(time.process_time() - start_cpu)
        breakdown.deactivate()
        on, off = statistics.median(times["on"]), statistics.median(times["off"])
        fastest = min(times["on"]) / min(times["off"])
        cpu_ratio = statistics.median(cpu["on"]) / statistics.median(cpu["off"])
        results[name] = {
            "off_s": round(off, 5),
            "on_s": round(on, 5),
            "ratio": round(on / off, 4),
            "ratio_of_fastest": round(fastest, 4),
            "cpu_ratio": round(cpu_ratio, 4),
            "phases_per_call": calls,
            "estimated_overhead": round(calls * pair / off, 6),
        }
        print(
            f"{name:<18} off {off * 1e3:8.2f} ms  on {on * 1e3:8.2f} ms  ratio {on / off:.4f} "
            f"(fastest {fastest:.4f}, CPU time {cpu_ratio:.4f})  "
            f"{calls} phases × {pair * 1e6:.2f} µs = {calls * pair / off:.4%} of the call"
        )
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
