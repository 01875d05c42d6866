import json
import math
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from asyncrl.metrics.jsonl import JsonlTail, JsonlWriter, read_jsonl
from asyncrl.metrics.record import StepRecord
from asyncrl.metrics.roles import REGISTRY, RoleMetrics
from asyncrl.metrics.server import MetricsServer, serve
from asyncrl.metrics.table import METRICS, metrics_doc
from asyncrl.reasons import EngineReason, EnvReason, GroupReason
from asyncrl.runstate import Counter

# The names the Grafana dashboard is built on (DESIGN §8): renaming one breaks it.
EXPECTED = {
    "asyncrl_policy_version": "gauge",
    "asyncrl_trajectories_produced": "counter",
    "asyncrl_trajectories_consumed": "counter",
    "asyncrl_trajectories_dropped": "counter",
    "asyncrl_queue_lag": "gauge",
    "asyncrl_queue_pending": "gauge",
    "asyncrl_queue_dead_letter": "gauge",
    "asyncrl_staleness": "histogram",
    "asyncrl_behaviour_weight_p50": "gauge",
    "asyncrl_behaviour_weight_p90": "gauge",
    "asyncrl_behaviour_weight_p99": "gauge",
    "asyncrl_behaviour_weight_mean": "gauge",
    "asyncrl_behaviour_weight_capped_fraction": "gauge",
    "asyncrl_clip_fraction": "gauge",
    "asyncrl_reward_mean": "gauge",
    "asyncrl_eval_accuracy": "gauge",
    "asyncrl_tokens_generated": "counter",
    "asyncrl_rollout_prompt_tokens": "counter",
    "asyncrl_rollout_tokens_per_second": "gauge",
    "asyncrl_train_step_seconds": "histogram",
    "asyncrl_train_steps": "counter",
    "asyncrl_train_steps_skipped": "counter",
    "asyncrl_trainer_mfu": "gauge",
    "asyncrl_weight_sync_seconds": "histogram",
    "asyncrl_weight_sync_bytes": "counter",
    "asyncrl_weight_publish_blocking_seconds": "histogram",
    "asyncrl_weight_sync_deltas": "counter",
    "asyncrl_weight_sync_rebuilds": "counter",
    "asyncrl_time_seconds": "counter",
    "asyncrl_redis_up": "gauge",
    "asyncrl_redis_reconnects": "counter",
    "asyncrl_workers_live": "gauge",
    "asyncrl_run_groups": "gauge",
}


HEALTHY = {"now": True}


@pytest.fixture
def server() -> Iterator[MetricsServer]:
    HEALTHY["now"] = True
    srv = serve("127.0.0.1", 0, lambda: (HEALTHY["now"], "no weights yet"))
    try:
        yield srv
    finally:
        srv.close()


def get(server: MetricsServer, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{server.port}{path}", timeout=5) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


def exercise(m: RoleMetrics) -> None:
    """Touch every metric once, as the role loops would."""
    m.policy_version.set(7)
    m.trajectories_produced.inc(3)
    m.trajectories_consumed.inc(2)
    m.trajectories_dropped["stale"].inc()
    m.queue_lag["prompts"].set(4)
    m.queue_pending["trajectories"].set(1)
    m.queue_dead_letter.set(0)
    m.behaviour_weight_p90.set(1.3)
    m.eval_accuracy.set(0.5)
    m.generated(100, 0.5, prompt_tokens=40, cached_tokens=30)
    m.trainer_mfu.set(0.3)
    m.weight_sync_seconds.observe(0.2)
    m.weight_sync_bytes.inc(1 << 20)
    m.weight_sync_rebuilds.inc()
    m.redis_up.set(1)
    m.redis_reconnects.inc()
    m.workers_live["rollout"].set(2)
    m.set_run_groups({Counter.PROMPTS_RELEASED: 10, Counter.GROUPS_TRAINED: 6})
    m.observe_step(
        StepRecord.from_json(
            {
                "step": 1,
                "version": 8,
                "groups": 4,
                "reward_mean": 0.25,
                "clip_fraction": 0.1,
                "behaviour_weight_mean": 0.98,
                "behaviour_weight_capped_fraction": 0.01,
                "behaviour_weight_p50": 1.0,
                "step_seconds": 0.7,
                "weight_publish_blocking_seconds": 0.002,
                "skipped_nonfinite": True,
            }
        ),
        staleness=[0, 1, 1, 3],
    )


def test_metrics_endpoint_exposes_the_dashboard_names(server: MetricsServer) -> None:
    trainer = RoleMetrics("trainer", "test-t0")
    exercise(trainer)
    with trainer.time_phase("train"):
        time.sleep(0.01)
    exercise(RoleMetrics("rollout", "test-w1"))

    status, body = get(server, "/metrics")
    assert status == 200
    families = {f.name: f for f in text_string_to_metric_families(body)}
    for name, kind in EXPECTED.items():
        assert name in families, name
        assert families[name].type == kind, name
    for family in families.values():
        assert family.name.startswith("asyncrl_")
        for sample in family.samples:
            assert ":" not in sample.name
            assert {"role", "worker"} <= set(sample.labels), sample
            if family.type == "counter":
                assert sample.name.endswith("_total"), sample.name  # no `_created` either

    def value(name: str, **labels: str) -> float:
        (match,) = [
            s.value
            for f in families.values()
            for s in f.samples
            if s.name == name and labels.items() <= s.labels.items()
        ]
        return match

    t0 = {"role": "trainer", "worker": "test-t0"}
    assert value("asyncrl_policy_version", **t0) == 8  # observe_step's version wins
    assert value("asyncrl_trajectories_consumed_total", **t0) == 2 + 4
    assert value("asyncrl_trajectories_dropped_total", reason="stale", **t0) == 1
    assert value("asyncrl_queue_lag", stream="prompts", **t0) == 4
    assert value("asyncrl_behaviour_weight_p50", **t0) == 1.0
    assert value("asyncrl_staleness_bucket", le="1.0", **t0) == 3
    assert value("asyncrl_staleness_count", **t0) == 4
    assert value("asyncrl_train_step_seconds_sum", **t0) == pytest.approx(0.7)
    assert value("asyncrl_train_steps_skipped_total", **t0) == 1
    assert value("asyncrl_rollout_tokens_per_second", **t0) == 200
    assert value("asyncrl_run_groups", outcome="released", **t0) == 10
    assert value("asyncrl_run_groups", outcome="dead_lettered", **t0) == 0
    assert value("asyncrl_time_seconds_total", phase="train", **t0) >= 0.01
    assert value("asyncrl_tokens_generated_total", role="rollout", worker="test-w1") == 100
    w1 = {"role": "rollout", "worker": "test-w1"}
    assert value("asyncrl_rollout_prompt_tokens_total", source="cached", **w1) == 30
    assert value("asyncrl_rollout_prompt_tokens_total", source="prefilled", **w1) == 10


def test_series_exist_only_where_used() -> None:
    RoleMetrics("trainer", "test-fresh")
    body = generate_latest(REGISTRY).decode()
    # The role's own counters start at zero, so rate() sees their first increment...
    assert 'asyncrl_train_steps_total{role="trainer",worker="test-fresh"} 0.0' in body
    # ...and gauges it has not set do not shadow the rank that does set them.
    assert not any("test-fresh" in line for line in body.splitlines() if "queue_lag" in line)


def test_time_phase_counts_failed_blocks_and_rejects_unknown_phases() -> None:
    m = RoleMetrics("rollout", "test-phase")
    with pytest.raises(RuntimeError), m.time_phase("generate"):
        time.sleep(0.01)
        raise RuntimeError("engine died")
    spent = REGISTRY.get_sample_value(
        "asyncrl_time_seconds_total",
        {"role": "rollout", "worker": "test-phase", "phase": "generate"},
    )
    assert spent is not None and spent >= 0.01
    with pytest.raises(KeyError), m.time_phase("generation"):
        pass


def test_healthz_follows_the_health_check(server: MetricsServer) -> None:
    assert get(server, "/healthz") == (200, "ok\n")
    HEALTHY["now"] = False
    assert get(server, "/healthz") == (503, "no weights yet\n")
    assert get(server, "/nope")[0] == 404


def test_healthz_is_503_when_the_check_raises() -> None:
    def broken() -> tuple[bool, str]:
        raise ConnectionError("redis gone")

    srv = serve(health=broken)
    try:
        code, body = get(srv, "/healthz")
    finally:
        srv.close()
    assert code == 503
    assert "redis gone" in body


def test_jsonl_round_trip_tolerates_a_truncated_line(tmp_path: Path) -> None:
    path = tmp_path / "run" / "metrics.jsonl"
    with JsonlWriter(path) as w:
        w.write({"step": 1, "loss": 0.5})
        w.write({"step": 2, "loss": math.nan, "grad_norm": math.inf})
    with path.open("a") as f:
        f.write('{"step": 3, "lo')  # a crash mid-write
    assert read_jsonl(path) == [
        {"step": 1, "loss": 0.5},
        {"step": 2, "loss": None, "grad_norm": None},  # standard JSON has no NaN
    ]
    for line in path.read_text().splitlines()[:2]:
        json.loads(line, parse_constant=lambda c: pytest.fail(f"non-standard JSON {c}"))

    with JsonlWriter(path) as w:  # the resumed run
        w.write({"step": 3, "loss": 0.4})
    assert [r["step"] for r in read_jsonl(path)] == [1, 2, 3]
    assert read_jsonl(path, tail_bytes=30) == [{"step": 3, "loss": 0.4}]


def test_jsonl_tail_reads_whole_lines_only(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    tail = JsonlTail(path)
    assert tail.read_new() == []  # no file yet
    with path.open("w") as f:
        f.write('{"step": 1}\n{"step": 2, "lo')
    assert tail.read_new() == [{"step": 1}]
    with path.open("a") as f:
        f.write('ss": 1}\n')
    assert tail.read_new() == [{"step": 2, "loss": 1}]
    assert tail.read_new() == []
    path.write_text('{"step": 0}\n')  # a fresh run in the same directory
    assert tail.read_new() == [{"step": 0}]


def test_docs_metrics_md_is_generated_from_the_table() -> None:
    doc = Path(__file__).resolve().parents[1] / "docs" / "metrics.md"
    assert doc.read_text() == metrics_doc(), "stale: run python tools/gen_dashboard.py"
    exported = {f.name: f.type for f in REGISTRY.collect()}
    for m in METRICS:
        assert exported[m.name.removesuffix("_total")] == m.kind, m.name
        assert f"`{m.name}`" in doc.read_text()


def test_tokens_per_second() -> None:
    def tokens_per_second(line: dict[str, float]) -> float | None:
        return StepRecord.from_json({"step": 1, **line}).throughput

    assert tokens_per_second({"tokens": 300, "step_seconds": 1.5}) == 200
    assert tokens_per_second({"tokens_per_second": 42.0, "tokens": 1}) == 42.0
    assert tokens_per_second({"tokens": 300, "step_seconds": 0}) is None
    assert tokens_per_second({"step": 1}) is None


def test_metrics_imports_nothing_heavy() -> None:
    code = (
        "import sys, asyncrl.metrics.roles, asyncrl.metrics.jsonl, asyncrl.metrics.poller, "
        "asyncrl.metrics.server; "
        "print([m for m in ('torch', 'numpy', 'redis', 'rich', 'matplotlib', 'pydantic') "
        "if m in sys.modules])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_metrics_import_none_of_their_subjects() -> None:
    """The table takes its label values from `asyncrl.reasons`: counting what tasks,
    environments, engines or rollout workers do needs none of them loaded."""
    code = (
        "import json, sys, asyncrl.metrics.roles, asyncrl.metrics.poller, asyncrl.metrics.server; "
        "names = [m.split('.')[1] for m in sys.modules if m.startswith('asyncrl.')]; "
        "print(json.dumps(names))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    loaded = set(json.loads(out.stdout))
    assert not loaded & {"tasks", "environments", "engines", "rollout", "trainer"}, loaded


def test_every_engine_and_environment_reason_has_its_group_reason() -> None:
    """A group failed by an engine or environment call is dead-lettered as `engine_{reason}` or
    `env_{reason}`: each must be a label value of `asyncrl_rollout_groups_failed_total`, not
    counted as `other`."""
    made = {f"engine_{r}" for r in EngineReason} | {f"env_{r}" for r in EnvReason}
    assert made <= set(GroupReason), made - set(GroupReason)
