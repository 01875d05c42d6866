"""Per-call cost of the `math` reward: the current one (math-verify) against an older revision's,
side by side in one run.

    python tools/bench_reward.py [--base 4959bbd] [--calls 2000]

The older reward is read from git at `--base` (the regex normaliser before math-verify), so
nothing is copied here. Workloads: `quickstart`, bare sums as the tiny model answers `a+b=`
(right, off by a few, or cut short); `gsm8k`, `#### n` answer lines; `latex`, `\\boxed{}`
fractions and expressions. Each call is timed alone; the table gives medians in microseconds
and new/old ratios, and the last line is the same as JSON.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import time
import types
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

Reward = Callable[[str, str], float]


def old_reward(base: str) -> Reward:
    source = subprocess.run(
        ["git", "show", f"{base}:asyncrl/tasks/rewards.py"],
        cwd=REPO,
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    module = types.ModuleType("rewards_at_base")
    exec(compile(source, f"{base}:asyncrl/tasks/rewards.py", "exec"), module.__dict__)
    return module.math_reward  # type: ignore[no-any-return]


def workloads(calls: int, seed: int = 0) -> dict[str, list[tuple[str, str]]]:
    rng = random.Random(seed)
    sums = [(rng.randint(10, 99), rng.randint(10, 99)) for _ in range(calls)]

    def near(total: int) -> str:
        return str(total + rng.choice([0, 0, 0, -1, 1, 10]))[: rng.choice([1, 2, 3, 3, 3])]

    latex = [
        ("\\boxed{\\frac{1}{2}}", "0.5"),
        ("so \\boxed{\\dfrac{3}{4}}.", "\\frac{3}{4}"),
        ("\\boxed{x^2+1}", "x^2 + 1"),
        ("\\boxed{2\\sqrt{2}}", "\\sqrt{8}"),
    ]
    return {
        "quickstart": [(near(a + b), str(a + b)) for a, b in sums],
        "gsm8k": [(f"... so {a} * 2 = {2 * a}\n#### {a + b}", str(a + b)) for a, b in sums],
        "latex": [latex[i % len(latex)] for i in range(calls)],
    }


def median_us(reward: Reward, pairs: list[tuple[str, str]]) -> float:
    for response, reference in pairs[:20]:
        reward(response, reference)  # warm caches and lazy imports out of the timing
    times = []
    for response, reference in pairs:
        t0 = time.perf_counter_ns()
        reward(response, reference)
        times.append(time.perf_counter_ns() - t0)
    return statistics.median(times) / 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", default="4959bbd", help="git revision of the older reward")
    parser.add_argument("--calls", type=int, default=2000, help="calls per workload")
    args = parser.parse_args()

    from asyncrl.tasks.rewards import math_reward

    old = old_reward(args.base)
    result = {}
    print(f"{'workload':<12}{'old µs':>10}{'new µs':>10}{'new/old':>10}")
    for name, pairs in workloads(args.calls).items():
        before, after = median_us(old, pairs), median_us(math_reward, pairs)
        result[name] = {"old_us": round(before, 2), "new_us": round(after, 2)}
        result[name]["ratio"] = round(after / before, 2)
        print(f"{name:<12}{before:>10.2f}{after:>10.2f}{after / before:>10.2f}")
    print(json.dumps({"base": args.base, "calls": args.calls, "median": result}))


if __name__ == "__main__":
    main()
