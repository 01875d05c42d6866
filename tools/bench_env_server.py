"""CPU an episode costs behind `asyncrl env-server`, against the same environment in process.

    python tools/bench_env_server.py [--episodes 2000] [--concurrency 1 512] [--repeats 5]

Episodes of the agentic task's tool (`ArithmeticToolEnvironment`, answering at once: what is
measured is the protocol's cost, not the tool's) run `concurrency` at a time: reset, 3 steps,
close. In process they are awaited directly on one event loop; served, they go through
`RemotePool` (the rollout worker's client) to one `asyncrl env-server` process started here.
Per episode: the client's CPU (this process), the server's CPU (its /proc stat: Linux), and
wall time; medians over `repeats` rounds, each round after a warm-up. `overhead_x` = (client +
server CPU served) / (CPU in process): what serving an environment costs the machine. The last
line is the figures as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

from asyncrl.environments.base import Environment
from asyncrl.environments.client import RemotePool
from asyncrl.environments.config import RemoteEnvironmentConfig
from asyncrl.environments.server import spawn
from asyncrl.items import PromptItem
from asyncrl.tasks.agentic import ArithmeticToolEnvironment

TOOL = "asyncrl.tasks.agentic:ArithmeticToolEnvironment"
ITEM = PromptItem("12+34;56+78;11+11", "12+34=", [1, 2, 3], "12+34=46;56+78=134;11+11=22")
RESPONSES = ("46", "134", "22")


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a live process (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def episode(env: Environment) -> None:
    await env.reset(ITEM)
    for response in RESPONSES:
        await env.step(response)
    await env.close()


async def rounds(
    make: Callable[[], Environment],
    episodes: int,
    concurrency: int,
    repeats: int,
    server_cpu: Callable[[], float],
) -> dict[str, float]:
    """Median per-episode client CPU, server CPU and wall time (µs) over `repeats` rounds."""
    gate = asyncio.Semaphore(concurrency)

    async def one() -> None:
        async with gate:
            await episode(make())

    async def run(n: int) -> tuple[float, float, float]:
        c0, s0, t0 = time.process_time(), server_cpu(), time.perf_counter()
        await asyncio.gather(*(one() for _ in range(n)))
        return time.process_time() - c0, server_cpu() - s0, time.perf_counter() - t0

    await run(min(episodes, 200))  # connections opened, code warmed
    measured = [await run(episodes) for _ in range(repeats)]
    per = [tuple(1e6 * x / episodes for x in m) for m in measured]
    return {
        "client_us": statistics.median(p[0] for p in per),
        "server_us": statistics.median(p[1] for p in per),
        "wall_us": statistics.median(p[2] for p in per),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--episodes", type=int, default=2000, help="episodes per round (2000)")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 512])
    ap.add_argument("--repeats", type=int, default=5, help="rounds; medians are reported (5)")
    args = ap.parse_args()
    proc, url = spawn(TOOL, "--max-sessions", str(max(args.concurrency)))
    result: dict[str, float] = {}
    try:
        for c in args.concurrency:
            pool = RemotePool(RemoteEnvironmentConfig(urls=[url], max_sessions_per_server=c))
            cpu = partial(process_cpu_s, proc.pid)
            remote = asyncio.run(rounds(pool.environment, args.episodes, c, args.repeats, cpu))
            local = asyncio.run(
                rounds(ArithmeticToolEnvironment, args.episodes, c, args.repeats, lambda: 0.0)
            )
            overhead = (remote["client_us"] + remote["server_us"]) / local["client_us"]
            print(
                f"concurrency {c}: in process {local['client_us']:.0f} µs CPU/episode; served "
                f"client {remote['client_us']:.0f} + server {remote['server_us']:.0f} µs CPU, "
                f"{remote['wall_us']:.0f} µs wall/episode; overhead {overhead:.1f}×"
            )
            result |= {f"{k}_served_c{c}": v for k, v in remote.items()}
            result |= {f"cpu_us_inproc_c{c}": local["client_us"], f"overhead_x_c{c}": overhead}
    finally:
        proc.terminate()
        proc.wait()
    print(json.dumps({k: round(v, 1) for k, v in result.items()}))


if __name__ == "__main__":
    sys.exit(main())
