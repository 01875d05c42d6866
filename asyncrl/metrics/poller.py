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

from asyncrl.metrics.table import STREAMS

if TYPE_CHECKING:
    import redis

    from asyncrl.metrics.roles import RoleMetrics
    from asyncrl.runstate import Keys

log = logging.getLogger(__name__)


def refresh_run_gauges(metrics: RoleMetrics, client: redis.Redis, keys: Keys) -> dict[str, int]:
    """One read of the run's Redis state into the gauges: queue lag and pending per stream, the
    dead-letter length, live workers per pool and the run accounting; returns the live workers
    per pool. Redis errors propagate."""
    from asyncrl.runstate import live_workers, read_counters, stream_depths

    depths = stream_depths(client, keys)
    for stream in STREAMS:
        metrics.queue_lag[stream].set(depths[stream]["lag"])
        metrics.queue_pending[stream].set(depths[stream]["pending"])
    metrics.queue_dead_letter.set(depths["dlq"]["length"])
    live = {pool: len(workers) for pool, workers in live_workers(client, keys).items()}
    for pool, n in live.items():
        metrics.workers_live[pool].set(n)
    metrics.set_run_groups(read_counters(client, keys))
    return live


class RunGauges:
    """Keeps the run-wide gauges current from a daemon thread (trainer rank 0 runs one).

    A thread rather than a call per step: the gauges matter most when steps stop — a trainer
    waiting for rollouts that never come must still report zero live rollout workers and a
    growing queue. Each pass also sets `asyncrl_redis_up` (1 read, 0 failed); failures are
    logged at most every 30 s and never stop the thread. And since such a trainer is otherwise
    silent: once no rollout worker has had a live heartbeat for `starved_after_s`, a WARNING
    says what the trainer waits for, repeated every `starved_every_s` while it lasts.
    """

    def __init__(
        self,
        metrics: RoleMetrics,
        client: redis.Redis,
        keys: Keys,
        period_s: float = 5.0,
        starved_after_s: float = 30.0,
        starved_every_s: float = 60.0,
    ) -> None:
        self.metrics, self.client, self.keys, self.period_s = metrics, client, keys, period_s
        self.starved_after_s, self.starved_every_s = starved_after_s, starved_every_s
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
        rollout_seen = time.monotonic()
        next_starved_log = 0.0
        while True:
            try:
                live = refresh_run_gauges(self.metrics, self.client, self.keys)
                self.metrics.redis_up.set(1)
                now = time.monotonic()
                if live["rollout"]:
                    rollout_seen, next_starved_log = now, 0.0
                elif now - rollout_seen >= self.starved_after_s and now >= next_starved_log:
                    log.warning(
                        "trainer: no live rollout worker for %.0f s: waiting for trajectory "
                        "groups on %s; start rollout workers with this run.id and redis.url "
                        "(asyncrl launch --role rollout), or see their logs for why they exit",
                        now - rollout_seen,
                        self.keys.trajectories,
                    )
                    next_starved_log = now + self.starved_every_s
            except Exception as exc:  # an outage or a bad reply: report it, keep trying
                self.metrics.redis_up.set(0)
                if time.monotonic() >= next_log:
                    log.warning("run gauges: cannot read Redis: %s: %s", type(exc).__name__, exc)
                    next_log = time.monotonic() + 30.0
            if self._stop.wait(self.period_s):
                return
