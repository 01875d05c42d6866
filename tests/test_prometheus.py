"""A real Prometheus scrapes a short quickstart run: every series the Grafana dashboard and the
alert rules use must hold data, and the shipped config and rules, and a scrape of every family,
must pass promtool. Also the run-wide gauges (`asyncrl.metrics.poller.RunGauges`) against a
real Redis.

Needs the `prometheus` and `promtool` binaries (Debian: `apt-get install -y prometheus`, as
.ci/run does); skipped with that hint without them, failed under CI. Everything listens on
loopback and is stopped by its handle.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import signal
import subprocess
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import yaml
from prometheus_client.parser import text_string_to_metric_families

from asyncrl.heartbeat import Heartbeat
from asyncrl.launch.redis_server import RedisServer
from asyncrl.metrics.poller import RunGauges, refresh_run_gauges
from asyncrl.metrics.roles import REGISTRY, RoleMetrics
from asyncrl.metrics.server import serve
from asyncrl.metrics.table import METRICS
from asyncrl.runstate import PROMPTS_GROUP, Counter, Keys

from gen_dashboard import referenced_names
from role_procs import QUICKSTART, asyncrl, free_ports, wait_until

ROOT = Path(__file__).resolve().parents[1]
PROMETHEUS_DIR = ROOT / "deploy" / "prometheus"
APT_HINT = "apt-get install -y prometheus"
# Grafana's $__rate_interval for a 1 s scrape interval, give or take.
RATE_INTERVAL = "10s"


def _binary(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        # CI installs them (.ci/run): there a missing one is a failure, not a skip.
        if os.environ.get("CI"):
            pytest.fail(f"{name} not found: {APT_HINT}")
        pytest.skip(f"{name} not found: {APT_HINT}")
    return path


def _promtool(*args: str) -> None:
    result = subprocess.run(
        [_binary("promtool"), *args], cwd=PROMETHEUS_DIR, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_promtool_check_config() -> None:
    _promtool("check", "config", "prometheus.yml")


def test_promtool_check_rules() -> None:
    _promtool("check", "rules", "alerts.yml")


def test_promtool_rule_unit_tests() -> None:
    _promtool("test", "rules", "alerts_test.yml")


def test_promtool_check_metrics_on_a_scrape() -> None:
    """Every family, with every label value bound, as `/metrics` serves it passes promtool's
    parser and lint (a gauge with a `quantile` label, a counter without `_total`, ... fail)."""
    metrics = RoleMetrics("trainer", "promtool-test")
    for m in METRICS:
        getattr(metrics, m.attr)
    server = serve(port=0)
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=10) as r:
            scrape = r.read()
    finally:
        server.close()
    families = {m.name.removesuffix("_total") for m in METRICS}
    assert families <= {f.name for f in text_string_to_metric_families(scrape.decode())}
    result = subprocess.run(
        [_binary("promtool"), "check", "metrics"], input=scrape, capture_output=True
    )
    assert result.returncode == 0, (result.stdout + result.stderr).decode()


def test_run_gauges_mirror_redis(redis_server: RedisServer) -> None:
    """`refresh_run_gauges` reads queue depths, dead letters, heartbeats and the accounting."""
    client = redis.Redis.from_url(redis_server.url)
    keys = Keys("gauges")
    for i in range(3):
        client.xadd(keys.prompts, {"data": b"%d" % i})
    client.xgroup_create(keys.prompts, PROMPTS_GROUP, id="0")
    client.xreadgroup(PROMPTS_GROUP, "w1", {keys.prompts: ">"}, count=1)
    client.xadd(keys.dlq, {"reason": b"malformed"})
    for role, wid in (("rollout", "w1"), ("rollout", "w2"), ("trainer", "trainer-0")):
        Heartbeat(client, keys.worker(role, wid), ttl_s=30).beat()
    client.hset(
        keys.counters, mapping={Counter.PROMPTS_RELEASED: 3, Counter.GROUPS_DEAD_LETTERED: 1}
    )
    metrics = RoleMetrics("trainer", "gauges-test")
    gauges = RunGauges(metrics, client, keys, period_s=0.05).start()
    try:
        refresh_run_gauges(metrics, client, keys)

        def value(name: str, **labels: str) -> float | None:
            return REGISTRY.get_sample_value(
                name, {"role": "trainer", "worker": "gauges-test", **labels}
            )

        assert value("asyncrl_queue_lag", stream="prompts") == 2
        assert value("asyncrl_queue_pending", stream="prompts") == 1
        assert value("asyncrl_queue_lag", stream="trajectories") == 0
        assert value("asyncrl_queue_dead_letter") == 1
        assert value("asyncrl_workers_live", pool="rollout") == 2
        assert value("asyncrl_workers_live", pool="trainer") == 1
        assert value("asyncrl_run_groups", outcome="released") == 3
        assert value("asyncrl_run_groups", outcome="dead_lettered") == 1
        assert value("asyncrl_run_groups", outcome="trained") == 0
        deadline = time.monotonic() + 10
        while value("asyncrl_redis_up") != 1:
            assert time.monotonic() < deadline, "the thread never reported Redis up"
            time.sleep(0.05)
        redis_server.stop()
        while value("asyncrl_redis_up") != 0:
            assert time.monotonic() < deadline + 20, "the thread never reported the outage"
            time.sleep(0.05)
    finally:
        gauges.stop()
        client.close()


def test_run_gauges_warn_while_no_rollout_worker_is_live(
    redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    """No live rollout worker for `starved_after_s`: a WARNING naming what the trainer waits
    for, at most once per `starved_every_s` (not once per pass); none while one beats; again
    once its heartbeat has lapsed."""
    client = redis.Redis.from_url(redis_server.url)
    keys = Keys("starved")
    metrics = RoleMetrics("trainer", "starved-test")
    gauges = RunGauges(
        metrics, client, keys, period_s=0.02, starved_after_s=0.2, starved_every_s=1.0
    )

    def warnings() -> list[str]:
        return [r.getMessage() for r in caplog.records if "no live rollout worker" in r.message]

    with caplog.at_level(logging.WARNING, logger="asyncrl.metrics.poller"):
        started = time.monotonic()
        gauges.start()
        try:
            wait_until(lambda: bool(warnings()), 30, "the first warning")
            assert time.monotonic() - started >= 0.2
            assert keys.trajectories in warnings()[0]
            time.sleep(1.5)
            elapsed = time.monotonic() - started
            # Dozens of passes, one warning per second at most.
            assert 1 <= len(warnings()) <= 1 + elapsed / 1.0, warnings()
            Heartbeat(client, keys.worker("rollout", "w1"), ttl_s=1.0).beat()
            live = {"role": "trainer", "worker": "starved-test", "pool": "rollout"}
            wait_until(
                lambda: REGISTRY.get_sample_value("asyncrl_workers_live", live) == 1, 30, "a worker"
            )
            seen = len(warnings())
            time.sleep(0.5)  # the heartbeat is still live: nothing is logged
            assert len(warnings()) == seen
            wait_until(lambda: len(warnings()) > seen, 30, "the warning after the lapse")
        finally:
            gauges.stop()
            client.close()


def _get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as reply:
        return json.loads(reply.read())


@pytest.fixture
def prometheus(tmp_path: Path) -> Iterator[tuple[str, int]]:
    """A Prometheus on loopback that scrapes the trainer at the metrics port it yields, the
    rollout worker one above and an env-server two above, every second, with the shipped alert
    rules loaded."""
    binary = _binary("prometheus")
    metrics_port = free_ports(3)
    web_port = free_ports(1)
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(PROMETHEUS_DIR / "alerts.yml")],
        "scrape_configs": [
            {
                "job_name": "asyncrl-trainer",
                "static_configs": [{"targets": [f"127.0.0.1:{metrics_port}"]}],
            },
            {
                "job_name": "asyncrl-rollout",
                "static_configs": [{"targets": [f"127.0.0.1:{metrics_port + 1}"]}],
            },
            {
                "job_name": "asyncrl-env-server",
                "static_configs": [{"targets": [f"127.0.0.1:{metrics_port + 2}"]}],
            },
        ],
    }
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    log = (tmp_path / "prometheus.log").open("wb")
    proc = subprocess.Popen(
        [
            binary,
            f"--config.file={tmp_path / 'prometheus.yml'}",
            f"--storage.tsdb.path={tmp_path / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{web_port}",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    api = f"http://127.0.0.1:{web_port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(f"{api}/-/ready", timeout=2).close()
                break
            except OSError:
                assert proc.poll() is None, (tmp_path / "prometheus.log").read_text()
                assert time.monotonic() < deadline, "Prometheus did not become ready"
                time.sleep(0.2)
        yield api, metrics_port
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def _query_range(api: str, expr: str, start: float, end: float) -> list[dict[str, Any]]:
    params = urllib.parse.urlencode({"query": expr, "start": start, "end": end, "step": "1s"})
    reply = _get(f"{api}/api/v1/query_range?{params}")
    assert reply["status"] == "success", reply
    return list(reply["data"]["result"])


def _dashboard_exprs() -> list[str]:
    dashboard = json.loads((ROOT / "deploy/grafana/asyncrl.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    return [e.replace("$__rate_interval", RATE_INTERVAL) for e in exprs]


def _alert_metrics() -> set[str]:
    alerts = yaml.safe_load((PROMETHEUS_DIR / "alerts.yml").read_text())
    exprs = [r["expr"] for g in alerts["groups"] for r in g["rules"]]
    return set().union(*(referenced_names(e) for e in exprs))


def _serve_episodes(port: int) -> tuple[subprocess.Popen[str], Callable[[], None]]:
    """An `asyncrl env-server` of the agentic tool on `port`, and a thread running episodes on
    it until the returned function is called."""
    from asyncrl.environments.client import RemotePool
    from asyncrl.environments.config import RemoteEnvironmentConfig
    from asyncrl.environments.server import spawn
    from asyncrl.items import PromptItem

    proc, url = spawn("asyncrl.tasks.agentic:ArithmeticToolEnvironment", "--port", str(port))
    pool = RemotePool(RemoteEnvironmentConfig(urls=[url]))
    item = PromptItem("12+34;56+78", "12+34=", [1], "12+34=46;56+78=134")
    stop = threading.Event()

    async def episodes() -> None:
        while not stop.is_set():
            env = pool.environment()
            await env.reset(item)
            await env.step("46")
            await env.step("134")
            await asyncio.sleep(0.05)

    thread = threading.Thread(target=asyncio.run, args=(episodes(),), daemon=True)
    thread.start()

    def stop_episodes() -> None:
        stop.set()
        thread.join(10)

    return proc, stop_episodes


@pytest.mark.slow
def test_every_dashboard_and_alert_series_has_data(
    prometheus: tuple[str, int], tmp_path: Path, warm_model: Path
) -> None:
    api, metrics_port = prometheus
    start = time.time()
    # The quickstart has no environment: an env-server beside it serves episodes of the
    # agentic tool, so that its panels have data too.
    env_server, stop_episodes = _serve_episodes(metrics_port + 2)
    try:
        run = asyncrl(
            *("launch", "--role", "all", "--config", str(QUICKSTART)),
            *("--progress", "quiet", "--fresh"),
            "run.id=prometheus",
            f"run.dir={tmp_path / 'run'}",
            f"model.path={warm_model}",
            "rollout.workers=1",
            # 36 steps (about 8 s on 2 idle cores; 12 took 2.5 s, and a rate over a 10 s window
            # then sometimes had one scrape to go on), an eval every 2: several 1 s scrapes see
            # the counters grow and the eval gauge set.
            "trainer.max_steps=36",
            "trainer.checkpoint_every=6",
            "trainer.eval_every=2",
            "trainer.eval_size=100",
            f"metrics.port={metrics_port}",
            timeout=240,
        )
    finally:
        stop_episodes()
        env_server.terminate()
        env_server.wait()
    assert run.returncode == 0, run.stdout + run.stderr
    # Let Prometheus ingest the last scrapes before asking.
    time.sleep(2)
    end = time.time()

    for job in ("asyncrl-trainer", "asyncrl-rollout", "asyncrl-env-server"):
        up = _query_range(api, f'max_over_time(up{{job="{job}"}}[1m])', start, end)
        assert any(float(v) == 1 for s in up for _, v in s["values"]), f"{job} never scraped"

    empty = [e for e in _dashboard_exprs() if not _query_range(api, e, start, end)]
    empty += [m for m in sorted(_alert_metrics()) if not _query_range(api, m, start, end)]
    assert not empty, f"no data for: {empty}"

    rules = _get(f"{api}/api/v1/rules?type=alert")["data"]["groups"]
    loaded = {r["name"]: r["health"] for g in rules for r in g["rules"]}
    assert len(loaded) == 4 and set(loaded.values()) == {"ok"}, loaded
