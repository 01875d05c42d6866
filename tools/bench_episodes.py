"""The episode scheduler's own cost per group: one-turn and multi-turn episodes with an engine that
costs nothing and tools that answer at once, so what is measured is the scheduler, the turn
batcher and the episodes' own code (rendering, decoding, records, samples).

    python tools/bench_episodes.py [--groups 2000] [--n 8] [--turns 3] [--rounds 5]

A plain arithmetic task (one turn: generated and scored inline on the generating thread) and the
agentic task (`--turns` turns, each episode a coroutine on the environments' loop) run in this
process, groups of `--n` episodes kept 16 groups deep. Figures per kind (medians of `--rounds`):
CPU milliseconds of this process per group (`cpu_ms_per_group`), and wall milliseconds. The
same command from a checkout before issue 45 measures the scheduler it replaced (its module was
`asyncrl.rollout.episodes`), so the two are compared run for run on one machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import numpy as np

from asyncrl.engines.base import Generation
from asyncrl.engines.config import SamplingParams
from asyncrl.tasks.agentic import AgenticTask
from asyncrl.tasks.base import ArithmeticTask
from asyncrl.tasks.config import AgenticTaskConfig, ArithmeticTaskConfig
from asyncrl.tiny_model import EOS_ID, build_tokenizer

try:
    from asyncrl.rollout.scheduler import EpisodeScheduler
except ImportError:  # a checkout before issue 45: the scheduler it replaced
    from asyncrl.rollout.episodes import EpisodeScheduler

DEPTH = 16
"""Groups in flight at once."""


class FreeEngine:
    """Answers "46<eos>" to every prompt, at once."""

    version = 0

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        ids = np.array([7, 9, EOS_ID], np.int32)
        ones = np.full(3, -0.5, np.float32)
        return [Generation(ids, ones, np.zeros(3, np.int32), "stop") for _ in prompts]


def per_group(task: Any, groups: int, n: int) -> tuple[float, float]:
    """(CPU ms, wall ms) per group of `n` episodes, `groups` of them through one scheduler."""
    items = list(task.train_items(0, 0))
    sched: Any = EpisodeScheduler(
        FreeEngine(), task, build_tokenizer(), SamplingParams(max_new_tokens=4)
    )
    started = done = 0
    cpu, wall = time.process_time(), time.perf_counter()
    try:
        while done < groups:
            while started < groups and started - done < DEPTH:
                sched.start(started, items[started % len(items)], n, f"e{started}")
                started += 1
            finished, failed = sched.advance(0.05)
            assert not failed, failed
            done += len(finished)
        cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    finally:
        sched.close()
    return cpu / groups * 1e3, wall / groups * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--groups", type=int, default=2000, help="one-turn groups (multi-turn: 1/5)")
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    tok = build_tokenizer()
    kinds = {
        "one_turn": (ArithmeticTask(ArithmeticTaskConfig(eval_size=10, train_size=1000), tok), 1),
        f"{args.turns}_turn": (
            AgenticTask(
                AgenticTaskConfig(
                    turns=args.turns,
                    eval_size=10,
                    train_size=1000,
                    tool_latency_median_s=0.0,
                    tool_latency_sigma=0.0,
                ),
                tok,
            ),
            5,
        ),
    }
    result: dict[str, float] = {}
    for kind, (task, fewer) in kinds.items():
        runs = [per_group(task, args.groups // fewer, args.n) for _ in range(args.rounds)]
        result[f"{kind}_cpu_ms_per_group"] = statistics.median(r[0] for r in runs)
        result[f"{kind}_wall_ms_per_group"] = statistics.median(r[1] for r in runs)
        print(f"{kind}: CPU ms per group {[round(r[0], 3) for r in runs]}")
    print(json.dumps({k: round(v, 4) for k, v in result.items()}))


if __name__ == "__main__":
    main()
