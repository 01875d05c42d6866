"""The run-wide gauges: queue depths, dead letters, live workers and the run accounting, read
from Redis on a daemon thread of trainer rank 0.

They describe Redis state, not the exporting process' own work. `asyncrl_run_groups` is a gauge,
not a counter: its value is the run's absolute count read from Redis, which does not restart at
zero when the process that exports it does.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING

from asyncrl.keys import PROMPTS_GROUP, TRAJECTORIES_GROUP
from asyncrl.metrics.table import POOLS

if TYPE_CHECKING:
    import redis

    from asyncrl.keys import Keys
    from asyncrl.metrics.roles import RoleMetrics

log = logging.getLogger(__name__)


def refresh_run_gauges(metrics: RoleMetrics, client: redis.Redis, keys: Keys) -> None:
    """One read of the run's Redis state into the gauges: queue lag and pending per stream, the
    dead-letter length, live workers per pool and the run accounting. Redis errors propagate."""
    from asyncrl.heartbeat import live_workers
    from asyncrl.queue import stream_stats

    streams = {
        "prompts": (keys.prompts, PROMPTS_GROUP),
        "trajectories": (keys.trajectories, TRAJECTORIES_GROUP),
    }
    for stream, (key, group) in streams.items():
        stats = stream_stats(client, key, group)
        metrics.queue_lag[stream].set(stats["lag"])
        metrics.queue_pending[stream].set(stats["pending"])
    metrics.queue_dead_letter.set(int(client.xlen(keys.dlq)))
    for pool in POOLS:
        metrics.workers_live[pool].set(len(live_workers(client, keys, pool)))
    raw = client.hgetall(keys.counters)
    counters = {k.decode() if isinstance(k, bytes) else k: int(v) for k, v in raw.items()}
    metrics.set_run_groups(counters)


class RunGauges:
    """Keeps the run-wide gauges current from a daemon thread (trainer rank 0 runs one).

    A thread rather than a call per step: the gauges matter most when steps stop — a trainer
    waiting for rollouts that never come must still report zero live rollout workers and a
    growing queue. Each pass also sets `asyncrl_redis_up` (1 read, 0 failed); failures are
    logged at most every 30 s and never stop the thread.
    """

    def __init__(
        self, metrics: RoleMetrics, client: redis.Redis, keys: Keys, period_s: float = 5.0
    ) -> None:
        self.metrics, self.client, self.keys, self.period_s = metrics, client, keys, period_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> RunGauges:
        self._thread = threading.Thread(target=self._run, name="run-gauges", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(self.period_s + 10.0)
            self._thread = None

    def _run(self) -> None:
        next_log = 0.0
        while True:
            try:
                refresh_run_gauges(self.metrics, self.client, self.keys)
                self.metrics.redis_up.set(1)
            except Exception as exc:  # an outage or a bad reply: report it, keep trying
                self.metrics.redis_up.set(0)
                if time.monotonic() >= next_log:
                    log.warning("run gauges: cannot read Redis: %s: %s", type(exc).__name__, exc)
                    next_log = time.monotonic() + 30.0
            if self._stop.wait(self.period_s):
                return
