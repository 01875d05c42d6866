"""The Prometheus families of `table.METRICS` and their bindings to one process' labels.

A series exists only in the processes that use it: `RoleMetrics` binds a child on first use (and
the role's own ones, `Metric.roles`, at construction, so they start at zero), so e.g.
`asyncrl_queue_lag` is not shadowed by zeros from trainer ranks that never set it.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from asyncrl.metrics.breakdown import TimeSplit
from asyncrl.metrics.record import StepRecord
from asyncrl.metrics.table import BASE_LABELS, METRICS, Metric
from asyncrl.runstate import Counter as RunCounter

# The text format shows each counter's `_created` sample as a gauge family of its own: it would
# double the series count and no dashboard reads it.
prometheus_client.disable_created_metrics()

REGISTRY = CollectorRegistry()
"""The process' one registry; `serve` exposes it. Kept apart from prometheus_client's default one
so that only `asyncrl_` families are exported."""

_KINDS = {"counter": Counter, "gauge": Gauge, "histogram": Histogram}


def _family(m: Metric) -> Any:
    labels = (*BASE_LABELS, m.label[0]) if m.label else BASE_LABELS
    extra = {"buckets": m.buckets} if m.buckets is not None else {}
    return _KINDS[m.kind](m.name, m.help, labels, registry=REGISTRY, **extra)


_BY_ATTR = {m.attr: m for m in METRICS}
_FAMILIES = {m.attr: _family(m) for m in METRICS}


class RoleMetrics:
    """The metrics of one process, bound to its `role` and `worker` labels.

    Attributes are label-bound children, so hot paths do no label lookup:
    `m.trajectories_produced.inc()`, `m.staleness.observe(2)`, `m.queue_lag["prompts"].set(5)`.
    A metric with a label of its own is a dict keyed by the label value
    (`trajectories_dropped[reason]`, `time_seconds[phase]`, ...); an unknown value is a
    KeyError, not a new series. Each attribute is bound from its `table.METRICS` row on first
    access; the annotations below only give them their types, so a metric that only step
    records set (`observe_step`, by its `Metric.step_sources`) needs none.
    """

    policy_version: Gauge
    trajectories_produced: Counter
    trajectories_consumed: Counter
    trajectories_dropped: dict[str, Counter]
    queue_lag: dict[str, Gauge]
    queue_pending: dict[str, Gauge]
    queue_dead_letter: Gauge
    staleness: Histogram
    eval_accuracy: Gauge
    tokens_generated: Counter
    prompt_tokens: dict[str, Counter]
    rollout_tokens_per_second: Gauge
    train_steps: Counter
    weight_sync_seconds: Histogram
    weight_sync_bytes: Counter
    weight_sync_deltas: Counter
    weight_sync_rebuilds: Counter
    time_seconds: dict[str, Counter]
    breakdown_seconds: dict[str, Counter]
    time_fraction: dict[str, Gauge]
    redis_up: Gauge
    redis_reconnects: Counter
    workers_live: dict[str, Gauge]
    run_groups: dict[str, Gauge]
    staleness_bound: Gauge
    environment_errors: dict[str, Counter]
    rollout_groups_failed: dict[str, Counter]
    rollout_groups_dropped_stale: Counter
    env_server_sessions: Gauge
    env_server_requests: dict[str, Counter]
    env_server_call_seconds: Histogram
    env_server_sessions_closed_idle: Counter
    tool_calls: dict[str, Counter]
    gateway_sessions: Counter
    gateway_calls: Counter
    gateway_tokens: dict[str, Counter]
    gateway_call_seconds: Histogram
    gateway_stitch_breaks: dict[str, Counter]

    def __init__(self, role: str, worker: str) -> None:
        self.role = role
        self.worker = worker
        for m in METRICS:
            if role in m.roles:
                getattr(self, m.attr)

    def __getattr__(self, attr: str) -> Any:
        """Binds the metric `attr` on first access (later ones find the instance attribute)."""
        m = _BY_ATTR.get(attr)
        if m is None:
            raise AttributeError(attr)
        family = _FAMILIES[attr]
        base = {"role": self.role, "worker": self.worker}
        if m.label is None:
            bound = family.labels(**base)
        else:
            name, values = m.label
            bound = {v: family.labels(**base, **{name: v}) for v in values}
        setattr(self, attr, bound)
        return bound

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

    def observe_step(self, record: StepRecord, staleness: Iterable[int] = ()) -> None:
        """Exports one step record (each metric from its `Metric.step_field`) and the staleness
        of the groups trained in the step. The record's figures are run-wide (`groups` counts all
        ranks' groups), so call this where the record is written, once per step."""
        self.train_steps.inc()
        for m in _STEP_METRICS:
            bound = getattr(self, m.attr)
            for label, name in m.step_sources:
                value = getattr(record, name)
                if value is None:
                    continue
                child = bound if label is None else bound[label]
                if m.kind == "gauge":
                    child.set(value)
                elif m.kind == "histogram":
                    child.observe(value)
                else:
                    child.inc(float(value))
        for value in staleness:
            self.staleness.observe(value)

    def observe_split(self, split: TimeSplit) -> None:
        """Exports one interval of the role's time breakdown."""
        for name, fraction in split.fractions.items():
            self.breakdown_seconds[name].inc(fraction * split.seconds)
        self.observe_fractions(split)

    def observe_fractions(self, split: TimeSplit) -> None:
        """Exports the shares of one interval only, for a breakdown that adds its seconds to
        `breakdown_seconds` itself as each phase ends (`Breakdown(counters=...)`)."""
        for name, fraction in split.fractions.items():
            self.time_fraction[name].set(fraction)

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


_STEP_METRICS = tuple(m for m in METRICS if m.step_sources)
assert set(RoleMetrics.__annotations__) <= set(_BY_ATTR), (
    "RoleMetrics types a metric not in METRICS"
)
assert {m.attr for m in METRICS if not m.step_sources} <= set(RoleMetrics.__annotations__), (
    "a metric that no step record sets has no type on RoleMetrics"
)
