"""Prometheus metrics of every asyncrl process, and the run's JSONL metrics log (DESIGN §8).

Naming: prefix `asyncrl_`, base units (seconds, bytes), counters end in `_total`, no colons.
Every series carries `role` (trainer, rollout, launcher) and `worker` (trainer rank or rollout
worker id). The deploy/ Grafana dashboard is built on exactly these names; rename one only
together with it.

| metric | type | extra labels | set by |
|---|---|---|---|
| asyncrl_policy_version | gauge | | trainer: published; rollout: generating with |
| asyncrl_trajectories_produced_total | counter | | rollout |
| asyncrl_trajectories_consumed_total | counter | | trainer |
| asyncrl_trajectories_dropped_total | counter | reason: stale, zero_variance, invalid | trainer |
| asyncrl_queue_lag, asyncrl_queue_pending | gauge | stream: prompts, trajectories | trainer r0 |
| asyncrl_queue_dead_letter | gauge (dlq length) | | trainer r0 |
| asyncrl_staleness | histogram, buckets 0..16 | | trainer |
| asyncrl_behaviour_weight | gauge | quantile: 0.5, 0.9, 0.99 | trainer |
| asyncrl_behaviour_weight_mean, asyncrl_behaviour_weight_capped_fraction | gauge | | trainer |
| asyncrl_clip_fraction, asyncrl_reward_mean, asyncrl_eval_accuracy | gauge | | trainer |
| asyncrl_tokens_generated_total | counter | | rollout |
| asyncrl_rollout_prompt_tokens_total | counter | source: prefilled, cached | rollout |
| asyncrl_rollout_tokens_per_second | gauge (engine, last batch) | | rollout |
| asyncrl_train_step_seconds | histogram | | trainer |
| asyncrl_train_steps_total | counter | | trainer |
| asyncrl_trainer_mfu | gauge (0..1) | | trainer |
| asyncrl_weight_sync_seconds | histogram | | trainer: send; rollout: receive |
| asyncrl_weight_sync_bytes_total | counter | | trainer, rollout |
| asyncrl_weight_publish_blocking_seconds | histogram | | trainer |
| asyncrl_weight_sync_rebuilds_total | counter | | trainer, rollout |
| asyncrl_time_seconds_total | counter | phase: see PHASES | all |
| asyncrl_redis_up | gauge (1 up, 0 outage) | | all |
| asyncrl_redis_reconnects_total | counter | | all |
| asyncrl_workers_live | gauge | pool: rollout, trainer | trainer r0 |
| asyncrl_run_groups | gauge | outcome: see OUTCOMES | trainer r0 |
| asyncrl_staleness_bound | gauge (η in force; 0 in sync mode) | | trainer r0 |

`asyncrl_run_groups` mirrors the run-accounting hash in Redis (`runstate.Counter`, field
`prompts_released` → outcome `released`, `groups_trained` → `trained`, ..., `entries_rejected`
→ `rejected`). It is a gauge, not a counter: its value is the run's absolute count read from
Redis, which does not restart at zero when the process that exports it does.

The queue, worker and run-accounting gauges describe Redis state, not the exporting process' own
work: `RunGauges` re-reads them on a daemon thread (`refresh_run_gauges` is one read).

A series exists only in the processes that use it: `RoleMetrics` binds a child on first use (and
the role's own ones at construction, so they start at zero), so e.g. `asyncrl_queue_lag` is not
shadowed by zeros from trainer ranks that never set it.

The JSONL log (`{run.dir}/metrics.jsonl`, written by trainer rank 0) holds one object per line,
all with `step` and `wall_seconds`. Step lines (one per optimizer step) carry the step figures
(version, groups, tokens, reward_mean, staleness_mean, ...); eval lines carry `eval_accuracy`,
which is how the two are told apart (`is_eval_record`).
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from functools import cached_property
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import TYPE_CHECKING, Any

import prometheus_client
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from asyncrl.runstate import Counter as RunCounter

if TYPE_CHECKING:
    import redis

    from asyncrl.runstate import Keys

log = logging.getLogger(__name__)

# The text format shows each counter's `_created` sample as a gauge family of its own: it would
# double the series count and no dashboard reads it.
prometheus_client.disable_created_metrics()

REGISTRY = CollectorRegistry()
"""The process' one registry; `serve` exposes it. Kept apart from prometheus_client's default one
so that only `asyncrl_` families are exported."""

DROP_REASONS = ("stale", "zero_variance", "invalid")
STREAMS = ("prompts", "trajectories")
QUANTILES = ("0.5", "0.9", "0.99")
PHASES = (
    "generate",
    "score",
    "queue_wait",
    "publish",
    "train",
    "weight_sync",
    "checkpoint",
    "eval",
)
POOLS = ("rollout", "trainer")
PROMPT_SOURCES = ("prefilled", "cached")
OUTCOMES = tuple(c.outcome for c in RunCounter)

_L = ("role", "worker")


def _gauge(name: str, doc: str, *extra: str) -> Gauge:
    return Gauge(name, doc, (*_L, *extra), registry=REGISTRY)


def _counter(name: str, doc: str, *extra: str) -> Counter:
    return Counter(name, doc, (*_L, *extra), registry=REGISTRY)


def _histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
    return Histogram(name, doc, _L, registry=REGISTRY, buckets=buckets)


_POLICY_VERSION = _gauge(
    "asyncrl_policy_version",
    "Policy version: published (trainer) or generating with (rollout).",
)
_PRODUCED = _counter("asyncrl_trajectories_produced_total", "Trajectory groups published.")
_CONSUMED = _counter("asyncrl_trajectories_consumed_total", "Trajectory groups trained on.")
_DROPPED = _counter(
    "asyncrl_trajectories_dropped_total", "Trajectory groups dropped, by reason.", "reason"
)
_QUEUE_LAG = _gauge(
    "asyncrl_queue_lag", "Stream entries not yet delivered to the consumer group.", "stream"
)
_QUEUE_PENDING = _gauge(
    "asyncrl_queue_pending", "Stream entries delivered but not yet acked.", "stream"
)
_DEAD_LETTER = _gauge("asyncrl_queue_dead_letter", "Entries in the dead-letter stream.")
_STALENESS = _histogram(
    "asyncrl_staleness",
    "Staleness of trained groups: current version − oldest token version.",
    tuple(float(v) for v in range(17)),
)
_BW = _gauge(
    "asyncrl_behaviour_weight", "Quantiles of the truncated behaviour weights.", "quantile"
)
_BW_MEAN = _gauge("asyncrl_behaviour_weight_mean", "Mean behaviour weight over response tokens.")
_BW_CAPPED = _gauge(
    "asyncrl_behaviour_weight_capped_fraction", "Fraction of behaviour weights at the cap."
)
_CLIP = _gauge("asyncrl_clip_fraction", "Fraction of response tokens whose ratio was clipped.")
_REWARD = _gauge("asyncrl_reward_mean", "Mean reward of the groups of the last step.")
_EVAL = _gauge(
    "asyncrl_eval_accuracy", "Mean held-out episode reward (accuracy for 0/1 rewards), last eval."
)
_TOKENS = _counter("asyncrl_tokens_generated_total", "Response tokens generated.")
_PROMPT_TOKENS = _counter(
    "asyncrl_rollout_prompt_tokens_total",
    "Prompt tokens of engine calls, by source: prefilled, or cached (keys from the prefix cache).",
    "source",
)
_TOKENS_PER_S = _gauge(
    "asyncrl_rollout_tokens_per_second", "Engine generation throughput over the last batch."
)
_STEP_SECONDS = _histogram(
    "asyncrl_train_step_seconds",
    "Duration of one optimizer step.",
    (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 60, 120, 300, 600),
)
_STEPS = _counter("asyncrl_train_steps_total", "Optimizer steps taken.")
_SKIPPED = _counter(
    "asyncrl_train_steps_skipped_total",
    "Steps whose loss or gradient norm was not finite, so the optimizer did not step.",
)
_MFU = _gauge("asyncrl_trainer_mfu", "Model FLOPs utilisation of the last step (0..1).")
_SYNC_SECONDS = _histogram(
    "asyncrl_weight_sync_seconds",
    "Duration of one weight transfer (trainer: send; rollout: receive and swap).",
    (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
)
_SYNC_BYTES = _counter("asyncrl_weight_sync_bytes_total", "Bytes of weights transferred.")
_BLOCKING = _histogram(
    "asyncrl_weight_publish_blocking_seconds",
    "Time the trainer loop waited to hand weights to the publisher.",
    (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
)
_REBUILDS = _counter(
    "asyncrl_weight_sync_rebuilds_total", "Weight-sync group rebuilds (membership changes)."
)
_TIME = _counter("asyncrl_time_seconds_total", "Wall time spent per phase.", "phase")
_REDIS_UP = _gauge("asyncrl_redis_up", "1 while connected to Redis, 0 during an outage.")
_RECONNECTS = _counter("asyncrl_redis_reconnects_total", "Reconnections to Redis.")
_WORKERS = _gauge("asyncrl_workers_live", "Workers with a live heartbeat, by pool.", "pool")
_RUN_GROUPS = _gauge(
    "asyncrl_run_groups", "Run accounting from Redis: prompt groups by outcome.", "outcome"
)
_STALENESS_BOUND = _gauge(
    "asyncrl_staleness_bound",
    "Staleness bound in force (algo.max_staleness; 0 in sync mode), for the at-the-bound alert.",
)

# Step-line keys of metrics.jsonl → RoleMetrics attributes, so the log and /metrics agree.
STEP_GAUGES = {
    "version": "policy_version",
    "reward_mean": "reward_mean",
    "clip_fraction": "clip_fraction",
    "behaviour_weight_mean": "behaviour_weight_mean",
    "behaviour_weight_capped_fraction": "behaviour_weight_capped_fraction",
    "mfu": "trainer_mfu",
}
STEP_QUANTILES = {
    "behaviour_weight_p50": "0.5",
    "behaviour_weight_p90": "0.9",
    "behaviour_weight_p99": "0.99",
}
STEP_HISTOGRAMS = {
    "step_seconds": "train_step_seconds",
    "weight_publish_blocking_seconds": "weight_publish_blocking_seconds",
}

# What each role uses from the start; anything else is bound when first touched.
_ROLE_METRICS: dict[str, tuple[str, ...]] = {
    "rollout": (
        "policy_version",
        "trajectories_produced",
        "tokens_generated",
        "prompt_tokens",
        "rollout_tokens_per_second",
        "weight_sync_seconds",
        "weight_sync_bytes",
        "time_seconds",
        "redis_up",
        "redis_reconnects",
    ),
    "trainer": (
        "policy_version",
        "trajectories_consumed",
        "trajectories_dropped",
        "staleness",
        "train_step_seconds",
        "train_steps",
        "train_steps_skipped",
        "weight_sync_seconds",
        "weight_sync_bytes",
        "weight_publish_blocking_seconds",
        "time_seconds",
        "redis_up",
        "redis_reconnects",
    ),
}


class RoleMetrics:
    """The metrics of one process, bound to its `role` and `worker` labels.

    Attributes are label-bound children, so hot paths do no label lookup:
    `m.trajectories_produced.inc()`, `m.staleness.observe(2)`, `m.queue_lag["prompts"].set(5)`.
    Per-label families are dicts keyed by the label value (`trajectories_dropped[reason]`,
    `queue_lag[stream]`, `behaviour_weight[quantile]`, `time_seconds[phase]`,
    `workers_live[pool]`, `run_groups[outcome]`, `prompt_tokens[source]`); an unknown value is
    a KeyError, not a new series.
    """

    def __init__(self, role: str, worker: str) -> None:
        self.role = role
        self.worker = worker
        for name in _ROLE_METRICS.get(role, ()):
            getattr(self, name)

    def _bind(self, metric: Any, **extra: str) -> Any:
        return metric.labels(role=self.role, worker=self.worker, **extra)

    @cached_property
    def policy_version(self) -> Gauge:
        return self._bind(_POLICY_VERSION)

    @cached_property
    def trajectories_produced(self) -> Counter:
        return self._bind(_PRODUCED)

    @cached_property
    def trajectories_consumed(self) -> Counter:
        return self._bind(_CONSUMED)

    @cached_property
    def trajectories_dropped(self) -> dict[str, Counter]:
        return {r: self._bind(_DROPPED, reason=r) for r in DROP_REASONS}

    @cached_property
    def queue_lag(self) -> dict[str, Gauge]:
        return {s: self._bind(_QUEUE_LAG, stream=s) for s in STREAMS}

    @cached_property
    def queue_pending(self) -> dict[str, Gauge]:
        return {s: self._bind(_QUEUE_PENDING, stream=s) for s in STREAMS}

    @cached_property
    def queue_dead_letter(self) -> Gauge:
        return self._bind(_DEAD_LETTER)

    @cached_property
    def staleness(self) -> Histogram:
        return self._bind(_STALENESS)

    @cached_property
    def behaviour_weight(self) -> dict[str, Gauge]:
        return {q: self._bind(_BW, quantile=q) for q in QUANTILES}

    @cached_property
    def behaviour_weight_mean(self) -> Gauge:
        return self._bind(_BW_MEAN)

    @cached_property
    def behaviour_weight_capped_fraction(self) -> Gauge:
        return self._bind(_BW_CAPPED)

    @cached_property
    def clip_fraction(self) -> Gauge:
        return self._bind(_CLIP)

    @cached_property
    def reward_mean(self) -> Gauge:
        return self._bind(_REWARD)

    @cached_property
    def eval_accuracy(self) -> Gauge:
        return self._bind(_EVAL)

    @cached_property
    def tokens_generated(self) -> Counter:
        return self._bind(_TOKENS)

    @cached_property
    def prompt_tokens(self) -> dict[str, Counter]:
        return {s: self._bind(_PROMPT_TOKENS, source=s) for s in PROMPT_SOURCES}

    @cached_property
    def rollout_tokens_per_second(self) -> Gauge:
        return self._bind(_TOKENS_PER_S)

    @cached_property
    def train_step_seconds(self) -> Histogram:
        return self._bind(_STEP_SECONDS)

    @cached_property
    def train_steps(self) -> Counter:
        return self._bind(_STEPS)

    @cached_property
    def train_steps_skipped(self) -> Counter:
        return self._bind(_SKIPPED)

    @cached_property
    def trainer_mfu(self) -> Gauge:
        return self._bind(_MFU)

    @cached_property
    def weight_sync_seconds(self) -> Histogram:
        return self._bind(_SYNC_SECONDS)

    @cached_property
    def weight_sync_bytes(self) -> Counter:
        return self._bind(_SYNC_BYTES)

    @cached_property
    def weight_publish_blocking_seconds(self) -> Histogram:
        return self._bind(_BLOCKING)

    @cached_property
    def weight_sync_rebuilds(self) -> Counter:
        return self._bind(_REBUILDS)

    @cached_property
    def time_seconds(self) -> dict[str, Counter]:
        return {p: self._bind(_TIME, phase=p) for p in PHASES}

    @cached_property
    def redis_up(self) -> Gauge:
        return self._bind(_REDIS_UP)

    @cached_property
    def redis_reconnects(self) -> Counter:
        return self._bind(_RECONNECTS)

    @cached_property
    def workers_live(self) -> dict[str, Gauge]:
        return {p: self._bind(_WORKERS, pool=p) for p in POOLS}

    @cached_property
    def run_groups(self) -> dict[str, Gauge]:
        return {o: self._bind(_RUN_GROUPS, outcome=o) for o in OUTCOMES}

    @cached_property
    def staleness_bound(self) -> Gauge:
        return self._bind(_STALENESS_BOUND)

    @contextmanager
    def time_phase(self, phase: str) -> Iterator[None]:
        """Adds the wall time of the block to `asyncrl_time_seconds_total{phase}`, also when
        it raises (time lost to a failed step is still time spent)."""
        counter = self.time_seconds[phase]
        start = time.perf_counter()
        try:
            yield
        finally:
            counter.inc(time.perf_counter() - start)

    def observe_step(self, record: Mapping[str, Any], staleness: Iterable[int] = ()) -> None:
        """Exports one step line of metrics.jsonl (see `STEP_GAUGES`) and the staleness of the
        groups trained in the step. The line's figures are run-wide (`groups` counts all ranks'
        groups), so call this where the line is written, once per step."""
        self.train_steps.inc()
        if record.get("skipped_nonfinite"):
            self.train_steps_skipped.inc()
        self.trajectories_consumed.inc(record.get("groups", 0))
        for key, attr in STEP_GAUGES.items():
            value = record.get(key)
            if isinstance(value, int | float):
                getattr(self, attr).set(value)
        for key, quantile in STEP_QUANTILES.items():
            value = record.get(key)
            if isinstance(value, int | float):
                self.behaviour_weight[quantile].set(value)
        for key, attr in STEP_HISTOGRAMS.items():
            value = record.get(key)
            if isinstance(value, int | float):
                getattr(self, attr).observe(value)
        for value in staleness:
            self.staleness.observe(value)

    def redis_outage(self, outage: bool) -> None:
        """The queue's outage hook: Redis went away (True) or came back (False)."""
        self.redis_up.set(0 if outage else 1)
        if not outage:
            self.redis_reconnects.inc()

    def generated(
        self, tokens: int, seconds: float, prompt_tokens: int = 0, cached_tokens: int = 0
    ) -> None:
        """One engine batch: `tokens` response tokens in `seconds`, from prompts of
        `prompt_tokens` tokens of which `cached_tokens` came from the engine's prefix cache."""
        self.tokens_generated.inc(tokens)
        self.prompt_tokens["cached"].inc(cached_tokens)
        self.prompt_tokens["prefilled"].inc(prompt_tokens - cached_tokens)
        if seconds > 0:
            self.rollout_tokens_per_second.set(tokens / seconds)

    def set_run_groups(self, counters: Mapping[str, int]) -> None:
        """Mirrors the Redis `counters` hash (`runstate.Counters`; missing fields are 0)."""
        for c in RunCounter:
            self.run_groups[c.outcome].set(counters.get(c, 0))


def refresh_run_gauges(metrics: RoleMetrics, client: redis.Redis, keys: Keys) -> None:
    """One read of the run's Redis state into the gauges: queue lag and pending per stream, the
    dead-letter length, live workers per pool and the run accounting. Redis errors propagate."""
    from asyncrl.runstate import live_workers, read_counters, stream_depths

    depths = stream_depths(client, keys)
    for stream in STREAMS:
        metrics.queue_lag[stream].set(depths[stream]["lag"])
        metrics.queue_pending[stream].set(depths[stream]["pending"])
    metrics.queue_dead_letter.set(depths["dlq"]["length"])
    for pool, workers in live_workers(client, keys).items():
        metrics.workers_live[pool].set(len(workers))
    metrics.set_run_groups(read_counters(client, keys))


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


HealthCheck = Callable[[], tuple[bool, str]]
"""Returns (healthy, reason); the reason is the 503 body when unhealthy."""


class MetricsServer(ThreadingHTTPServer):
    """The process' HTTP endpoint; `port` is the bound one (useful with port 0)."""

    daemon_threads = True

    @property
    def port(self) -> int:
        return int(self.server_address[1])

    def close(self) -> None:
        self.shutdown()
        self.server_close()


def serve(
    host: str = "127.0.0.1",
    port: int = 0,
    health: HealthCheck = lambda: (True, "ok"),
    registry: CollectorRegistry = REGISTRY,
) -> MetricsServer:
    """Serves `/metrics` (Prometheus text format) and `/healthz` from a daemon thread.

    `/healthz` answers 200 `ok` while `health()` returns (True, _) — for the roles: connected to
    Redis and holding weights — else 503 with the reason. Port 0 picks a free port.
    """

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            path = self.path.split("?", 1)[0]
            if path == "/metrics":
                self._reply(200, generate_latest(registry), CONTENT_TYPE_LATEST)
            elif path == "/healthz":
                try:
                    ok, reason = health()
                except Exception as exc:  # a probe must answer, whatever the check does
                    ok, reason = False, f"health check failed: {exc!r}"
                body = "ok" if ok else reason
                self._reply(200 if ok else 503, f"{body}\n".encode(), "text/plain; charset=utf-8")
            else:
                self._reply(404, b"not found\n", "text/plain; charset=utf-8")

        def _reply(self, code: int, body: bytes, content_type: str) -> None:
            self.send_response(code)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            """Silent: a scrape every few seconds would flood the process log."""

    server = MetricsServer((host, port), Handler)
    threading.Thread(target=server.serve_forever, name="metrics-http", daemon=True).start()
    return server


def _plain(value: Any) -> Any:
    """JSON-ready data: NaN/inf become null (standard JSON has no such numbers, and jq or
    pandas would reject the line), numpy/torch scalars become Python numbers."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if hasattr(value, "item"):
        return _plain(value.item())
    raise TypeError(f"metrics.jsonl: cannot write a {type(value).__name__}")


class JsonlWriter:
    """Appends one JSON object per line to `path`, flushed per line so readers (progress,
    `asyncrl status`) see each step as soon as it is written."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a", encoding="utf-8")
        if self._file.tell() > 0 and not _ends_with_newline(self.path):
            # A crash mid-write left a partial line: end it, so the first record of the
            # resumed run does not merge into it.
            self._file.write("\n")

    def write(self, record: Mapping[str, Any]) -> None:
        self._file.write(json.dumps(_plain(record), separators=(",", ":")) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> JsonlWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _ends_with_newline(path: Path) -> bool:
    with path.open("rb") as f:
        f.seek(-1, 2)
        return f.read(1) == b"\n"


def _parse_lines(lines: list[bytes]) -> list[dict[str, Any]]:
    records = []
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue  # a line cut by a crash: the last one, or one a resumed writer ended
        if isinstance(record, dict):
            records.append(record)
    return records


def read_jsonl(path: str | Path, tail_bytes: int | None = None) -> list[dict[str, Any]]:
    """The records of a JSONL log, skipping lines cut short by a crash. With `tail_bytes`, only
    the records that lie wholly in the last `tail_bytes` bytes (a cheap look at the latest)."""
    with Path(path).open("rb") as f:
        size = f.seek(0, 2)
        start = 0 if tail_bytes is None else max(0, size - tail_bytes)
        f.seek(start)
        lines = f.read().splitlines()
    if start > 0:
        lines = lines[1:]
    return _parse_lines(lines)


class JsonlTail:
    """Reads the records appended to a JSONL log since the last call (file offset kept).

    Only whole lines are consumed: a line still being written is read on a later call. A missing
    file reads as empty; a file that shrank (a fresh run in the same directory) is re-read.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.offset = 0

    def read_new(self) -> list[dict[str, Any]]:
        try:
            with self.path.open("rb") as f:
                if f.seek(0, 2) < self.offset:
                    self.offset = 0
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return []
        end = data.rfind(b"\n") + 1
        self.offset += end
        return _parse_lines(data[:end].splitlines())


def is_eval_record(record: Mapping[str, Any]) -> bool:
    return "eval_accuracy" in record


def tokens_per_second(record: Mapping[str, Any]) -> float | None:
    """Trainer throughput of a step line: its `tokens_per_second` field if it has one, else
    tokens / step_seconds; None when neither is known."""
    value = record.get("tokens_per_second")
    if isinstance(value, int | float):
        return float(value)
    tokens, seconds = record.get("tokens"), record.get("step_seconds")
    if isinstance(tokens, int | float) and isinstance(seconds, int | float) and seconds > 0:
        return tokens / seconds
    return None
