"""Every Prometheus metric of asyncrl, one row each (DESIGN §8).

The families (`roles.REGISTRY`), the role bindings (`roles.RoleMetrics`), what a step record
sets (`RoleMetrics.observe_step`) and `docs/metrics.md` (`tools/gen_dashboard.py`) are all
generated from `METRICS`; adding a metric is adding a row (and its typed attribute on
`RoleMetrics`, unless only step records set it).

Naming: prefix `asyncrl_`, base units (seconds, bytes), counters end in `_total`, no colons.
Every series carries `role` (trainer, rollout, launcher) and `worker` (trainer rank or rollout
worker id). The deploy/ Grafana dashboard is built on exactly these names; rename one only
together with it. Importing this module imports no Prometheus client.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from asyncrl.metrics.breakdown import ALL_PHASES
from asyncrl.reasons import BreakCause, DropReason, EnvReason, GroupReason, ToolCallOutcome
from asyncrl.runstate import ROLES
from asyncrl.runstate import Counter as RunCounter

STREAMS = ("prompts", "trajectories")
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
POOLS = ROLES
PROMPT_SOURCES = ("prefilled", "cached")
MISMATCH_SCOPES = ("trained", "audit", "audit_low_prob", "audit_high_prob")
ROUTING_SCOPES = ("used", "router", "worst_layer")
LENGTH_SETS = ("generated", "trained")
OUTCOMES = tuple(c.outcome for c in RunCounter)
"""`asyncrl_run_groups` mirrors the run-accounting hash in Redis: field `prompts_released` →
outcome `released`, `groups_trained` → `trained`, ..., `entries_rejected` → `rejected`."""

BASE_LABELS = ("role", "worker")

Kind = Literal["counter", "gauge", "histogram"]


@dataclass(frozen=True)
class Metric:
    attr: str
    """The `RoleMetrics` attribute bound to it."""
    name: str
    """The exported family name (counters with their `_total`)."""
    kind: Kind
    help: str
    set_by: str
    """Which processes set it, for the docs table."""
    label: tuple[str, tuple[str, ...]] | None = None
    """The one label beyond `role` and `worker`, and all its values: the binding is a dict keyed
    by value, and an unknown value is a KeyError, not a new series."""
    buckets: tuple[float, ...] | None = None
    """Histogram buckets."""
    step_field: str | None = None
    """The `StepRecord` field that `observe_step` sets it from (gauge: set; histogram: observe;
    counter: add), if any."""
    step_fields: tuple[tuple[str, str], ...] = ()
    """For a labelled gauge set from a step line: (label value, StepRecord field) pairs."""
    roles: tuple[str, ...] = ()
    """Roles that bind it at construction, so that it starts at zero; others bind it at first
    use, and a series exists only in the processes that use it."""

    @property
    def step_sources(self) -> tuple[tuple[str | None, str], ...]:
        """(label value, StepRecord field) pairs a step record sets it from; the label value is
        None for a metric without a label of its own."""
        if self.step_field is not None:
            return ((None, self.step_field),)
        return self.step_fields


_BOTH = ("rollout", "trainer")
_TRAINER = ("trainer",)

METRICS: tuple[Metric, ...] = (
    Metric(
        "policy_version",
        "asyncrl_policy_version",
        "gauge",
        "Policy version: published (trainer) or generating with (rollout).",
        "trainer: published; rollout: generating with",
        step_field="version",
        roles=_BOTH,
    ),
    Metric(
        "trajectories_produced",
        "asyncrl_trajectories_produced_total",
        "counter",
        "Trajectory groups published.",
        "rollout",
        roles=("rollout",),
    ),
    Metric(
        "trajectories_consumed",
        "asyncrl_trajectories_consumed_total",
        "counter",
        "Trajectory groups trained on.",
        "trainer",
        step_field="groups",
        roles=_TRAINER,
    ),
    Metric(
        "trajectories_dropped",
        "asyncrl_trajectories_dropped_total",
        "counter",
        "Trajectory groups dropped, by reason.",
        "trainer",
        label=("reason", tuple(DropReason)),
        roles=_TRAINER,
    ),
    Metric(
        "queue_lag",
        "asyncrl_queue_lag",
        "gauge",
        "Stream entries not yet delivered to the consumer group.",
        "trainer r0",
        label=("stream", STREAMS),
    ),
    Metric(
        "queue_pending",
        "asyncrl_queue_pending",
        "gauge",
        "Stream entries delivered but not yet acked.",
        "trainer r0",
        label=("stream", STREAMS),
    ),
    Metric(
        "queue_dead_letter",
        "asyncrl_queue_dead_letter",
        "gauge",
        "Entries in the dead-letter stream.",
        "trainer r0",
    ),
    Metric(
        "staleness",
        "asyncrl_staleness",
        "histogram",
        "Staleness of trained groups: current version − oldest token version.",
        "trainer",
        buckets=tuple(float(v) for v in range(17)),
        roles=_TRAINER,
    ),
    # The quantiles as one gauge each: a gauge with a `quantile` label fails `promtool check
    # metrics` (that label is a summary's), and they are the last step's figures, not the
    # running ones a summary would hold.
    Metric(
        "behaviour_weight_p50",
        "asyncrl_behaviour_weight_p50",
        "gauge",
        "Median of the truncated behaviour weights of the last step.",
        "trainer",
        step_field="behaviour_weight_p50",
    ),
    Metric(
        "behaviour_weight_p90",
        "asyncrl_behaviour_weight_p90",
        "gauge",
        "90th percentile of the truncated behaviour weights of the last step.",
        "trainer",
        step_field="behaviour_weight_p90",
    ),
    Metric(
        "behaviour_weight_p99",
        "asyncrl_behaviour_weight_p99",
        "gauge",
        "99th percentile of the truncated behaviour weights of the last step.",
        "trainer",
        step_field="behaviour_weight_p99",
    ),
    Metric(
        "behaviour_weight_mean",
        "asyncrl_behaviour_weight_mean",
        "gauge",
        "Mean behaviour weight over response tokens.",
        "trainer",
        step_field="behaviour_weight_mean",
    ),
    Metric(
        "behaviour_weight_capped_fraction",
        "asyncrl_behaviour_weight_capped_fraction",
        "gauge",
        "Fraction of behaviour weights at the cap.",
        "trainer",
        step_field="behaviour_weight_capped_fraction",
    ),
    Metric(
        "clip_fraction",
        "asyncrl_clip_fraction",
        "gauge",
        "Fraction of response tokens whose ratio was clipped.",
        "trainer",
        step_field="clip_fraction",
    ),
    Metric(
        "reward_mean",
        "asyncrl_reward_mean",
        "gauge",
        "Mean reward of the groups of the last step.",
        "trainer",
        step_field="reward_mean",
    ),
    Metric(
        "eval_accuracy",
        "asyncrl_eval_accuracy",
        "gauge",
        "Mean held-out episode reward (accuracy for 0/1 rewards), last eval.",
        "trainer",
    ),
    Metric(
        "tokens_generated",
        "asyncrl_tokens_generated_total",
        "counter",
        "Response tokens generated.",
        "rollout",
        roles=("rollout",),
    ),
    Metric(
        "prompt_tokens",
        "asyncrl_rollout_prompt_tokens_total",
        "counter",
        "Prompt tokens of engine calls, by source: prefilled, or cached (keys from the prefix "
        "cache).",
        "rollout",
        label=("source", PROMPT_SOURCES),
        roles=("rollout",),
    ),
    Metric(
        "rollout_tokens_per_second",
        "asyncrl_rollout_tokens_per_second",
        "gauge",
        "Engine generation throughput over the last batch.",
        "rollout",
        roles=("rollout",),
    ),
    Metric(
        "train_step_seconds",
        "asyncrl_train_step_seconds",
        "histogram",
        "Duration of one optimizer step.",
        "trainer",
        buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 60, 120, 300, 600),
        step_field="step_seconds",
        roles=_TRAINER,
    ),
    Metric(
        "train_steps",
        "asyncrl_train_steps_total",
        "counter",
        "Optimizer steps taken.",
        "trainer",
        roles=_TRAINER,
    ),
    Metric(
        "train_steps_skipped",
        "asyncrl_train_steps_skipped_total",
        "counter",
        "Steps whose loss or gradient norm was not finite, so the optimizer did not step.",
        "trainer",
        step_field="skipped_nonfinite",
        roles=_TRAINER,
    ),
    Metric(
        "trainer_mfu",
        "asyncrl_trainer_mfu",
        "gauge",
        "Model FLOPs utilisation of the last step (0..1).",
        "trainer",
        step_field="mfu",
    ),
    Metric(
        "weight_sync_seconds",
        "asyncrl_weight_sync_seconds",
        "histogram",
        "Duration of one weight transfer (trainer: send; rollout: receive and swap).",
        "trainer: send; rollout: receive",
        buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
        roles=_BOTH,
    ),
    Metric(
        "weight_sync_bytes",
        "asyncrl_weight_sync_bytes_total",
        "counter",
        "Bytes of weights transferred.",
        "trainer, rollout",
        roles=_BOTH,
    ),
    Metric(
        "weight_publish_blocking_seconds",
        "asyncrl_weight_publish_blocking_seconds",
        "histogram",
        "Time the trainer loop waited to hand weights to the publisher.",
        "trainer",
        buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
        step_field="weight_publish_blocking_seconds",
        roles=_TRAINER,
    ),
    Metric(
        "weight_sync_deltas",
        "asyncrl_weight_sync_deltas_total",
        "counter",
        "Weight versions sent as sparse deltas (`weights.delta`); the rest went in full.",
        "trainer",
        roles=_TRAINER,
    ),
    Metric(
        "weight_sync_rebuilds",
        "asyncrl_weight_sync_rebuilds_total",
        "counter",
        "Weight-sync group rebuilds (membership changes).",
        "trainer, rollout",
    ),
    Metric(
        "time_seconds",
        "asyncrl_time_seconds_total",
        "counter",
        "Wall time spent per phase.",
        "all",
        label=("phase", PHASES),
        roles=_BOTH,
    ),
    Metric(
        "breakdown_seconds",
        "asyncrl_breakdown_seconds_total",
        "counter",
        "Wall time of the role's thread per phase of its time breakdown, every second of it "
        "in exactly one phase (trainer: wait, collate, proximal, forward_backward, all_reduce, "
        "optimizer, publish, checkpoint, other; rollout: prefill, decode, generate, env, hold, "
        "weight_swap, publish, other): rate over the sum of rates is the share. A rollout "
        "worker adds each phase's time as it ends; the trainer once a step.",
        "trainer r0, rollout",
        label=("phase", ALL_PHASES),
    ),
    Metric(
        "time_fraction",
        "asyncrl_time_fraction",
        "gauge",
        "Share of the last interval (trainer: step; rollout: metrics.breakdown_every_s) per "
        "phase of the time breakdown; a role's phases sum to 1.",
        "trainer r0, rollout",
        label=("phase", ALL_PHASES),
    ),
    Metric(
        "redis_up",
        "asyncrl_redis_up",
        "gauge",
        "1 while connected to Redis, 0 during an outage.",
        "all",
        roles=_BOTH,
    ),
    Metric(
        "redis_reconnects",
        "asyncrl_redis_reconnects_total",
        "counter",
        "Reconnections to Redis.",
        "all",
        roles=_BOTH,
    ),
    Metric(
        "workers_live",
        "asyncrl_workers_live",
        "gauge",
        "Workers with a live heartbeat, by pool.",
        "trainer r0",
        label=("pool", POOLS),
    ),
    Metric(
        "run_groups",
        "asyncrl_run_groups",
        "gauge",
        "Run accounting from Redis: prompt groups by outcome.",
        "trainer r0",
        label=("outcome", OUTCOMES),
    ),
    Metric(
        "staleness_bound",
        "asyncrl_staleness_bound",
        "gauge",
        "Staleness bound in force (algo.max_staleness; 0 in sync mode), for the at-the-bound "
        "alert.",
        "trainer r0",
    ),
    Metric(
        "length_bias_ks",
        "asyncrl_length_bias_ks",
        "gauge",
        "Length bias over the trainer's last 1,000 steps: the largest two-sample KS statistic "
        "(turns, tokens, seconds) between groups generated and groups trained (0: none dropped).",
        "trainer r0",
        step_field="length_bias_ks",
    ),
    *(
        Metric(
            f"episode_{measure}",
            f"asyncrl_episode_{measure}",
            "gauge",
            f"Mean {what} of the longest episode of the step's groups, generated (trained or "
            "dropped stale) and trained.",
            "trainer r0",
            label=("set", LENGTH_SETS),
            step_fields=tuple((side, f"episode_{measure}_{side}") for side in LENGTH_SETS),
        )
        for measure, what in (
            ("turns", "turns"),
            ("tokens", "response tokens"),
            ("seconds", "wall seconds, start to publishing,"),
        )
    ),
    Metric(
        "tokens_lag_masked_fraction",
        "asyncrl_tokens_lag_masked_fraction",
        "gauge",
        "Fraction of the step's trained tokens left out of the loss for being older than "
        "algo.max_token_lag versions.",
        "trainer r0",
        step_field="tokens_lag_masked_fraction",
    ),
    Metric(
        "logprob_mismatch",
        "asyncrl_logprob_mismatch_abs_diff",
        "gauge",
        "Mean |trainer - behaviour| log-prob of the step: over every trained token (trained), "
        "and at lag 0 over the rollout audit's tokens (audit), those of behaviour probability "
        "< 0.1 (audit_low_prob) and >= 0.1 (audit_high_prob).",
        "trainer r0",
        label=("scope", MISMATCH_SCOPES),
        step_fields=(
            ("trained", "mismatch_logprob_abs_diff"),
            ("audit", "audit_logprob_abs_diff"),
            ("audit_low_prob", "audit_logprob_abs_diff_low_prob"),
            ("audit_high_prob", "audit_logprob_abs_diff_high_prob"),
        ),
    ),
    Metric(
        "importance_ratio_mean",
        "asyncrl_importance_ratio_mean",
        "gauge",
        "Mean importance ratio trainer / behaviour probability over the step's trained tokens.",
        "trainer r0",
        step_field="mismatch_ratio_mean",
    ),
    Metric(
        "audit_logprob_abs_diff",
        "asyncrl_audit_logprob_abs_diff",
        "histogram",
        "Per step, the mean |trainer - behaviour| log-prob of the rollout audit (pure engine "
        "mismatch at lag 0).",
        "trainer r0",
        buckets=(1e-7, 1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 1e-1, 1.0),
        step_field="audit_logprob_abs_diff",
    ),
    Metric(
        "environment_errors",
        "asyncrl_environment_errors_total",
        "counter",
        "Environment calls that failed their episode, by reason: the environment raised, "
        "outlived its timeout, answered outside the protocol, or no env-server could take or "
        "keep the episode.",
        "rollout",
        label=("reason", tuple(EnvReason)),
        roles=("rollout",),
    ),
    Metric(
        "rollout_groups_failed",
        "asyncrl_rollout_groups_failed_total",
        "counter",
        "Prompt groups a rollout worker gave up and dead-lettered, by reason.",
        "rollout",
        label=("reason", tuple(GroupReason)),
        roles=("rollout",),
    ),
    Metric(
        "env_server_sessions",
        "asyncrl_env_server_sessions",
        "gauge",
        "Sessions open on an env-server (at most --max-sessions).",
        "env-server",
        roles=("env-server",),
    ),
    Metric(
        "env_server_requests",
        "asyncrl_env_server_requests_total",
        "counter",
        "Session requests an env-server answered (create, step, close), by outcome: ok, "
        "refused (a request that does not fit, an unknown session, the server full), or how "
        "the environment failed.",
        "env-server",
        label=("outcome", ("ok", "refused", *EnvReason)),
        roles=("env-server",),
    ),
    Metric(
        "env_server_call_seconds",
        "asyncrl_env_server_call_seconds",
        "histogram",
        "Seconds of each environment call (reset, step, close) on an env-server.",
        "env-server",
        buckets=(0.001, 0.01, 0.1, 0.5, 1.0, 5.0, 30.0, 120.0, 600.0),
        roles=("env-server",),
    ),
    Metric(
        "env_server_sessions_closed_idle",
        "asyncrl_env_server_sessions_closed_idle_total",
        "counter",
        "Sessions an env-server closed because no call used them for --idle-timeout-s (their "
        "workers gone without closing them).",
        "env-server",
        roles=("env-server",),
    ),
    Metric(
        "rollout_groups_dropped_stale",
        "asyncrl_rollout_groups_dropped_stale_total",
        "counter",
        "Prompt groups a rollout worker gave up before they ended, their oldest token already "
        "more than max_staleness versions behind its weights (the trainer would drop them).",
        "rollout",
        roles=("rollout",),
    ),
    Metric(
        "routing_agreement",
        "asyncrl_routing_agreement",
        "gauge",
        "Mixture-of-experts models: fraction of the step's recorded tokens and MoE layers whose "
        "top-k expert set in the trainer's forward equals the rollout engine's (used: 1 under "
        "algo.routing_replay; router: what the trainer's router picked itself; worst_layer: "
        "the lowest layer's used agreement).",
        "trainer r0",
        label=("scope", ROUTING_SCOPES),
        step_fields=(
            ("used", "routing_agreement"),
            ("router", "routing_agreement_router"),
            ("worst_layer", "routing_agreement_worst_layer"),
        ),
    ),
    Metric(
        "tool_calls",
        "asyncrl_tool_calls_total",
        "counter",
        "Tool calls in model output (task.environment type tools), by outcome: ok (it ran and "
        "returned), a call that could not be parsed (malformed_json, bad_call, unclosed_call), "
        "unknown_tool, bad_arguments, too_many_calls, or the tool raised or returned what JSON "
        "cannot write (tool_error), outlived its timeout (tool_timeout), or was refused because "
        "the sync tool's threads are all held by calls not returned (tool_busy). The model "
        "reads each failure; none fails a group.",
        "rollout",
        label=("outcome", tuple(ToolCallOutcome)),
        roles=("rollout",),
    ),
    Metric(
        "gateway_sessions",
        "asyncrl_gateway_sessions_total",
        "counter",
        "Agent episodes (task.agent) a rollout worker's gateway opened a session for; agents "
        "that failed are asyncrl_rollout_groups_failed_total's agent_* reasons.",
        "rollout",
        roles=("rollout",),
    ),
    Metric(
        "gateway_calls",
        "asyncrl_gateway_calls_total",
        "counter",
        "Chat completion calls agents made through the gateway and got an answer to.",
        "rollout",
        roles=("rollout",),
    ),
    Metric(
        "gateway_tokens",
        "asyncrl_gateway_tokens_total",
        "counter",
        "Tokens of the gateway's answered calls: their prompts and what was generated.",
        "rollout",
        label=("kind", ("prompt", "generated")),
        roles=("rollout",),
    ),
    Metric(
        "gateway_call_seconds",
        "asyncrl_gateway_call_seconds",
        "histogram",
        "Seconds from a gateway call's arrival to its answer (waiting for a batch included).",
        "rollout",
        buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 120.0),
        roles=("rollout",),
    ),
    Metric(
        "gateway_stitch_breaks",
        "asyncrl_gateway_stitch_breaks_total",
        "counter",
        "Gateway calls that did not continue their episode's sample and began a new one, by "
        "cause: history or reply edited, tools or template options changed, a template that "
        "re-renders earlier turns, parallel calls.",
        "rollout",
        label=("cause", tuple(BreakCause)),
        roles=("rollout",),
    ),
)


_DOC_HEAD = """\
# Metrics

Generated from `asyncrl/metrics/table.py` by `python tools/gen_dashboard.py` (which also writes
the Grafana dashboard); `python tools/gen_dashboard.py --check` fails when this file is stale.

Every series carries `role` (trainer, rollout, launcher) and `worker` (trainer rank or rollout
worker id); the labels below are the extra ones, with all their values. A series exists only in
the processes that use it. Counters end in `_total`; units are seconds and bytes.

`asyncrl_run_groups` mirrors the run-accounting hash in Redis (field `prompts_released` →
outcome `released`, `groups_trained` → `trained`, ..., `entries_rejected` → `rejected`). It is
a gauge, not a counter: its value is the run's absolute count read from Redis. It, the queue and
the worker gauges describe Redis state and are re-read every 5 s by trainer rank 0
(`asyncrl/metrics/poller.py`).

A "step-record field" is the `StepRecord` field (`asyncrl/metrics/record.py`, one line of
`{run.dir}/metrics.jsonl`) that each step sets the metric from.

"""


def metrics_doc() -> str:
    """`docs/metrics.md`: the prose above and one table row per metric."""
    lines = [
        "| metric | type | labels | set by | step-record field | help |",
        "|---|---|---|---|---|---|",
    ]
    for m in METRICS:
        labels = f"{m.label[0]}: {', '.join(m.label[1])}" if m.label else ""
        field = m.step_field or ", ".join(f for _, f in m.step_fields)
        kind = f"{m.kind}, buckets {m.buckets[0]:g}…{m.buckets[-1]:g}" if m.buckets else m.kind
        lines.append(f"| `{m.name}` | {kind} | {labels} | {m.set_by} | {field} | {m.help} |")
    return _DOC_HEAD + "\n".join(lines) + "\n"
