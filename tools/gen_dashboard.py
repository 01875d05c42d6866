"""Generate the Grafana dashboard deploy/grafana/asyncrl.json from the panels below, and
docs/metrics.md from the metric table (asyncrl/metrics/table.py).

    python tools/gen_dashboard.py           # (re)write both
    python tools/gen_dashboard.py --check   # exit 1 if either differs from what this generates

Every query is checked against the metric families `asyncrl.metrics.roles` registers, so a
renamed or removed metric fails here (and in tests/test_deploy.py) instead of leaving an empty
panel. The data source is a template variable: the file holds no data-source uid and imports
anywhere.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "deploy" / "grafana" / "asyncrl.json"
METRICS_DOC = ROOT / "docs" / "metrics.md"
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
RATE = "[$__rate_interval]"


@dataclass
class Panel:
    title: str
    description: str
    targets: list[tuple[str, str]]
    """(PromQL, legend) pairs."""
    unit: str = "short"
    stacked: bool = False
    heatmap: bool = False


def _one(title: str, expr: str, legend: str, description: str, **kw: Any) -> Panel:
    """A panel of one query."""
    return Panel(title, description, [(expr, legend)], **kw)


def _q(fraction: float, histogram: str, by: str = "le") -> str:
    return f"histogram_quantile({fraction}, sum by ({by}) (rate({histogram}_bucket{RATE})))"


def _mean(histogram: str, by: str = "") -> str:
    grouping = f" by ({by}) " if by else ""
    total, count = f"rate({histogram}_sum{RATE})", f"rate({histogram}_count{RATE})"
    return f"sum{grouping}({total}) / sum{grouping}({count})"


def _phase_share(role: str) -> str:
    """Seconds per second of each phase = its share of wall time, averaged over processes."""
    return f'avg by (phase) (rate(asyncrl_time_seconds_total{{role="{role}"}}{RATE}))'


def _phase_panel(role: str, whose: str, over: str) -> Panel:
    return _one(
        f"{role.capitalize()} time per phase",
        _phase_share(role),
        "{{phase}}",
        f"Share of the {whose} wall time per phase (mean over {over}).",
        unit="percentunit",
        stacked=True,
    )


def _breakdown_panel(role: str, whose: str) -> Panel:
    """Each phase's seconds over all phases' seconds: the stack fills exactly 100 %."""
    seconds = f'rate(asyncrl_breakdown_seconds_total{{role="{role}"}}{RATE})'
    return _one(
        f"{role.capitalize()} time breakdown",
        f"sum by (phase) ({seconds}) / scalar(sum({seconds}))",
        "{{phase}}",
        f"Share of the {whose} wall time per phase of the time breakdown "
        "(docs/bottlenecks.md); the phases sum to 1.",
        unit="percentunit",
        stacked=True,
    )


ROWS: list[tuple[str, list[Panel]]] = [
    (
        "Progress",
        [
            Panel(
                "Policy version",
                "Version the trainer published last, and the one each rollout engine generates "
                "with.",
                [
                    ('max(asyncrl_policy_version{role="trainer"})', "trainer (published)"),
                    ('asyncrl_policy_version{role="rollout"}', "{{worker}}"),
                ],
            ),
            Panel(
                "Rollout weights lag",
                "Published version minus the version each rollout worker generates with.",
                [
                    (
                        'max(asyncrl_policy_version{role="trainer"}) - on() group_right() '
                        'asyncrl_policy_version{role="rollout"}',
                        "{{worker}}",
                    )
                ],
            ),
            _one(
                "Optimizer steps per second",
                f"sum(rate(asyncrl_train_steps_total{RATE}))",
                "steps/s",
                "Optimizer steps taken by the trainer.",
            ),
        ],
    ),
    (
        "Throughput",
        [
            Panel(
                "Tokens generated per second",
                "Response tokens per rollout worker, and the engines' own throughput over their "
                "last batch.",
                [
                    (
                        f"sum by (worker) (rate(asyncrl_tokens_generated_total{RATE}))",
                        "{{worker}}",
                    ),
                    ("sum(asyncrl_rollout_tokens_per_second)", "engines, last batch"),
                ],
            ),
            Panel(
                "Prompt tokens from the prefix cache",
                "Share of the engines' prompt tokens whose keys came from the prefix cache rather "
                "than a prefill (multi-turn episodes: every turn after the first).",
                [
                    (
                        "sum by (worker) (rate(asyncrl_rollout_prompt_tokens_total"
                        f'{{source="cached"}}{RATE})) / sum by (worker) '
                        f"(rate(asyncrl_rollout_prompt_tokens_total{RATE}))",
                        "{{worker}}",
                    )
                ],
                unit="percentunit",
            ),
            Panel(
                "Trajectory groups per second",
                "Groups published by the rollout pool, trained on, and dropped (by reason).",
                [
                    (f"sum(rate(asyncrl_trajectories_produced_total{RATE}))", "produced"),
                    (f"sum(rate(asyncrl_trajectories_consumed_total{RATE}))", "trained"),
                    (
                        f"sum by (reason) (rate(asyncrl_trajectories_dropped_total{RATE}))",
                        "dropped: {{reason}}",
                    ),
                ],
            ),
            Panel(
                "Train step duration",
                "Wall time of one optimizer step, weight hand-off included.",
                [
                    (_q(0.5, "asyncrl_train_step_seconds"), "p50"),
                    (_q(0.9, "asyncrl_train_step_seconds"), "p90"),
                    (_mean("asyncrl_train_step_seconds"), "mean"),
                ],
                unit="s",
            ),
        ],
    ),
    (
        "Queues",
        [
            _one(
                "Queue lag",
                "asyncrl_queue_lag",
                "{{stream}}",
                "Stream entries not yet delivered to their consumer group.",
            ),
            _one(
                "Queue pending",
                "asyncrl_queue_pending",
                "{{stream}}",
                "Entries delivered but not acked (the trainer acks at each checkpoint).",
            ),
            _one(
                "Dead letters",
                "asyncrl_queue_dead_letter",
                "dead-letter stream",
                "Length of the dead-letter stream: entries that failed validation or were "
                "delivered too often.",
            ),
            _one(
                "Run accounting",
                "asyncrl_run_groups",
                "{{outcome}}",
                "Prompt groups by outcome, from Redis: released = trained + dropped stale + "
                "dead-lettered + lost + in flight; rejected counts junk and duplicate entries.",
            ),
        ],
    ),
    (
        "Staleness and off-policy correction",
        [
            _one(
                "Staleness distribution",
                f"sum by (le) (increase(asyncrl_staleness_bucket{RATE}))",
                "{{le}}",
                "Trained groups by staleness (trainer version − oldest token version).",
                heatmap=True,
            ),
            Panel(
                "Staleness mean and bound",
                "Mean staleness of trained groups and the bound η; a mean within ½ of η means "
                "most groups arrive at the bound.",
                [
                    (_mean("asyncrl_staleness"), "mean"),
                    ("max(asyncrl_staleness_bound)", "bound η"),
                ],
            ),
            Panel(
                "Length bias",
                "KS statistic between the episode lengths of groups generated and trained "
                "(0 under stale_policy train; dropping stale groups drops the long ones), and "
                "the share of trained tokens masked for their age.",
                [
                    ("max(asyncrl_length_bias_ks)", "KS generated vs trained"),
                    ("max(asyncrl_tokens_lag_masked_fraction)", "tokens masked for lag"),
                ],
            ),
            _one(
                "Episode tokens",
                "max by (set) (asyncrl_episode_tokens)",
                "{{set}}",
                "Mean response tokens of the longest episode per group, generated and trained.",
            ),
            Panel(
                "Behaviour weights",
                "Truncated importance weights π_prox / π_behaviour over response tokens.",
                [
                    ("asyncrl_behaviour_weight_p50", "p50"),
                    ("asyncrl_behaviour_weight_p90", "p90"),
                    ("asyncrl_behaviour_weight_p99", "p99"),
                    ("asyncrl_behaviour_weight_mean", "mean"),
                ],
            ),
            Panel(
                "Clipping",
                "Fraction of response tokens whose ratio was clipped, and of behaviour weights "
                "at the cap.",
                [
                    ("asyncrl_clip_fraction", "ratio clipped"),
                    ("asyncrl_behaviour_weight_capped_fraction", "behaviour weight capped"),
                ],
                unit="percentunit",
            ),
            _one(
                "Train/inference mismatch",
                "asyncrl_logprob_mismatch_abs_diff",
                "{{scope}}",
                "Mean |trainer − behaviour| log-prob: every trained token (engine mismatch plus "
                "policy change), and the rollout audit at lag 0 (pure engine mismatch), split at "
                "behaviour probability 0.1. `asyncrl mismatch RUN_DIR` has the full table.",
            ),
        ],
    ),
    (
        "Learning",
        [
            _one(
                "Reward mean",
                "asyncrl_reward_mean",
                "reward",
                "Mean reward of the groups of the last step.",
            ),
            _one(
                "Eval accuracy",
                "asyncrl_eval_accuracy",
                "held-out accuracy",
                "Mean held-out episode reward (accuracy for 0/1 rewards) at the last evaluation.",
                unit="percentunit",
            ),
            _one(
                "MFU",
                "asyncrl_trainer_mfu",
                "{{worker}}",
                "Model FLOPs utilisation of the last step, per trainer rank.",
                unit="percentunit",
            ),
        ],
    ),
    (
        "Weight sync",
        [
            Panel(
                "Weight sync duration",
                "One weight transfer: trainer send, rollout receive and swap.",
                [
                    (_q(0.9, "asyncrl_weight_sync_seconds", "le, role"), "{{role}} p90"),
                    (_mean("asyncrl_weight_sync_seconds", "role"), "{{role}} mean"),
                ],
                unit="s",
            ),
            Panel(
                "Trainer blocked on weight publish",
                "Time the training loop waited to hand new weights to the publisher.",
                [
                    (_q(0.9, "asyncrl_weight_publish_blocking_seconds"), "p90"),
                    (_mean("asyncrl_weight_publish_blocking_seconds"), "mean"),
                ],
                unit="s",
            ),
            _one(
                "Weight bytes per second",
                f"sum by (role) (rate(asyncrl_weight_sync_bytes_total{RATE}))",
                "{{role}}",
                "Bytes of weights sent (trainer) and received (rollout).",
                unit="Bps",
            ),
        ],
    ),
    (
        "Workers and time",
        [
            _one(
                "Live workers",
                "asyncrl_workers_live",
                "{{pool}}",
                "Workers with a live heartbeat in Redis, by pool.",
            ),
            _phase_panel("trainer", "trainer's", "ranks"),
            _phase_panel("rollout", "rollout workers'", "workers"),
        ],
    ),
    (
        "Time breakdown (asyncrl doctor RUN_DIR reads it as advice)",
        [
            _breakdown_panel("trainer", "trainer's step"),
            _breakdown_panel("rollout", "rollout workers' loop (all workers)"),
        ],
    ),
    (
        "Environments",
        [
            _one(
                "Environment errors",
                f"sum by (reason) (rate(asyncrl_environment_errors_total{RATE}))",
                "{{reason}}",
                "Episodes failed by their environment (in the worker or an env-server), by "
                "reason; unavailable: no env-server could take or keep the episode.",
                stacked=True,
            ),
            _one(
                "Groups failed in rollout",
                f"sum by (reason) (rate(asyncrl_rollout_groups_failed_total{RATE}))",
                "{{reason}}",
                "Prompt groups rollout workers dead-lettered, by reason.",
                stacked=True,
            ),
            _one(
                "Tool calls",
                f"sum by (outcome) (rate(asyncrl_tool_calls_total{RATE}))",
                "{{outcome}}",
                "Tool calls in model output, by outcome: ok, or why the call did not run or "
                "failed (the model is told; the episode goes on).",
                stacked=True,
            ),
            _one(
                "Env-server sessions",
                "sum by (instance) (asyncrl_env_server_sessions)",
                "{{instance}}",
                "Sessions open per env-server (at most its --max-sessions).",
            ),
            _one(
                "Env-server requests",
                f"sum by (outcome) (rate(asyncrl_env_server_requests_total{RATE}))",
                "{{outcome}}",
                "Session requests the env-servers answered, by outcome.",
                stacked=True,
            ),
            Panel(
                "Env-server call time",
                "Seconds of each environment call on the env-servers (reset, step, close): "
                "median and 99th percentile.",
                [
                    (_q(0.5, "asyncrl_env_server_call_seconds"), "p50"),
                    (_q(0.99, "asyncrl_env_server_call_seconds"), "p99"),
                ],
                unit="s",
            ),
        ],
    ),
    (
        "Agent gateway",
        [
            Panel(
                "Agent calls and sessions",
                "Chat calls the rollout workers' gateways answered, and agent episodes started "
                "(task.agent), per second.",
                [
                    (f"sum(rate(asyncrl_gateway_calls_total{RATE}))", "calls"),
                    (f"sum(rate(asyncrl_gateway_sessions_total{RATE}))", "sessions"),
                ],
            ),
            _one(
                "Agent tokens",
                f"sum by (kind) (rate(asyncrl_gateway_tokens_total{RATE}))",
                "{{kind}}",
                "Tokens per second of the gateway's calls: prompts and generated.",
                stacked=True,
            ),
            Panel(
                "Agent call time",
                "Seconds from a gateway call's arrival to its answer (batching included): "
                "median and 99th percentile.",
                [
                    (_q(0.5, "asyncrl_gateway_call_seconds"), "p50"),
                    (_q(0.99, "asyncrl_gateway_call_seconds"), "p99"),
                ],
                unit="s",
            ),
            _one(
                "Stitch breaks",
                f"sum by (cause) (rate(asyncrl_gateway_stitch_breaks_total{RATE}))",
                "{{cause}}",
                "Gateway calls that began a new sample of their episode, by cause (an edited "
                "history, changed tools, a template that re-renders earlier turns, ...). Agent "
                "failures are the agent_* reasons of Groups failed in rollout.",
                stacked=True,
            ),
        ],
    ),
]


def _panel_json(panel: Panel, pid: int, x: int, y: int, w: int) -> dict[str, object]:
    targets = [
        {
            "datasource": DATASOURCE,
            "expr": expr,
            "legendFormat": legend,
            "refId": chr(ord("A") + i),
            **({"format": "heatmap"} if panel.heatmap else {}),
        }
        for i, (expr, legend) in enumerate(panel.targets)
    ]
    common = {
        "id": pid,
        "title": panel.title,
        "description": panel.description,
        "datasource": DATASOURCE,
        "gridPos": {"h": 8, "w": w, "x": x, "y": y},
        "targets": targets,
    }
    if panel.heatmap:
        return {
            **common,
            "type": "heatmap",
            "options": {
                "calculate": False,
                "cellGap": 1,
                "color": {"mode": "scheme", "scheme": "Oranges", "steps": 64},
                "yAxis": {"axisLabel": "staleness"},
                "tooltip": {"mode": "single", "yHistogram": True},
            },
        }
    custom: dict[str, object] = {"lineWidth": 1, "fillOpacity": 30 if panel.stacked else 10}
    if panel.stacked:
        custom["stacking"] = {"mode": "normal", "group": "A"}
    return {
        **common,
        "type": "timeseries",
        "fieldConfig": {"defaults": {"unit": panel.unit, "custom": custom}, "overrides": []},
        "options": {
            "legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
            "tooltip": {"mode": "multi", "sort": "desc"},
        },
    }


def build() -> dict[str, object]:
    panels: list[dict[str, object]] = []
    y = 0
    pid = 1
    for title, row in ROWS:
        panels.append(
            {
                "id": pid,
                "type": "row",
                "title": title,
                "collapsed": False,
                "gridPos": {"h": 1, "w": 24, "x": 0, "y": y},
                "panels": [],
            }
        )
        pid += 1
        y += 1
        width = 24 // len(row)
        for i, panel in enumerate(row):
            panels.append(_panel_json(panel, pid, i * width, y, width))
            pid += 1
        y += 8
    return {
        "uid": "asyncrl",
        "title": "asyncrl",
        "description": "Asynchronous RL run: rollout and trainer pools joined by Redis "
        "(generated by tools/gen_dashboard.py; edit that, not this file).",
        "tags": ["asyncrl"],
        "editable": True,
        "schemaVersion": 39,
        "version": 1,
        "time": {"from": "now-1h", "to": "now"},
        "refresh": "10s",
        "timezone": "",
        "annotations": {"list": []},
        "templating": {
            "list": [
                {
                    "name": "datasource",
                    "label": "Data source",
                    "type": "datasource",
                    "query": "prometheus",
                    "current": {},
                    "hide": 0,
                    "refresh": 1,
                    "regex": "",
                    "options": [],
                }
            ]
        },
        "panels": panels,
    }


def exported_names() -> set[str]:
    """Every sample name the asyncrl processes can export (`_total`, `_bucket`, ... included)."""
    from asyncrl.metrics.roles import REGISTRY

    suffixes = {
        "counter": ("_total",),
        "gauge": ("",),
        "histogram": ("_bucket", "_sum", "_count"),
    }
    return {
        family.name + suffix for family in REGISTRY.collect() for suffix in suffixes[family.type]
    }


def referenced_names(expr: str) -> set[str]:
    return set(re.findall(r"\basyncrl_[a-z0-9_]+", expr))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare, do not write")
    args = parser.parse_args()
    known = exported_names()
    unknown = {
        name
        for _, row in ROWS
        for panel in row
        for expr, _ in panel.targets
        for name in referenced_names(expr) - known
    }
    if unknown:
        print(f"queries use metrics asyncrl does not export: {sorted(unknown)}", file=sys.stderr)
        return 1
    from asyncrl.metrics.table import metrics_doc

    generated = {
        OUT: json.dumps(build(), indent=2, ensure_ascii=False) + "\n",
        METRICS_DOC: metrics_doc(),
    }
    if args.check:
        stale = [p for p, text in generated.items() if not p.is_file() or p.read_text() != text]
        for path in stale:
            print(f"{path} is stale: run python tools/gen_dashboard.py", file=sys.stderr)
        return 1 if stale else 0
    for path, text in generated.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
