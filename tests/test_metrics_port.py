"""Two asyncrl processes on one host with one config collide on `metrics.port`: the second
exits 2 with one line naming the key, before it joins the run; the local launcher checks the
ports it hands out before it starts anything."""

from __future__ import annotations

import socket
import urllib.request
from pathlib import Path

import redis

from asyncrl.launch.redis_server import RedisServer
from asyncrl.runstate import Keys, live_workers

from role_procs import Role, RoleConfig, asyncrl, free_ports, local_run_config, wait_until


def _serves_metrics(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as reply:
            return reply.status == 200
    except OSError:
        return False


def _one_line_error(stderr: str) -> str:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    return lines[0]


def test_a_second_role_on_a_taken_port_exits_2_with_one_line(
    role_config: RoleConfig, redis_server: RedisServer, tmp_path: Path
) -> None:
    port = free_ports(1)
    config = role_config("ports", {"metrics.port": port})
    trainer = Role("trainer", config, tmp_path / "logs" / "trainer.log")
    try:
        wait_until(lambda: _serves_metrics(port), 120, "the trainer's /metrics", [trainer])
        second = asyncrl("launch", "--role", "rollout", "--config", str(config), timeout=120)
        assert second.returncode == 2, second.stdout + second.stderr
        line = _one_line_error(second.stderr)
        assert line.startswith(f"asyncrl: config error: metrics.port: 127.0.0.1:{port} is "), line
        assert "already in use" in line and "metrics.port to a free port" in line, line
        # It never joined the run: no heartbeat of a rollout worker.
        client = redis.Redis.from_url(redis_server.url)
        assert live_workers(client, Keys("ports"))["rollout"] == []
        client.close()
        assert trainer.alive() and _serves_metrics(port)  # the first one is untouched
    finally:
        trainer.stop()


def test_local_mode_checks_every_port_before_starting(tmp_path: Path, random_model: Path) -> None:
    """Local mode gives rollout worker i `metrics.port + 1 + i`: a process holding the worker's
    port stops the launch at once, and no Redis, log or child is started."""
    base = free_ports(3)
    config = local_run_config(
        tmp_path / "config.yaml",
        tmp_path / "run",
        random_model,
        {"metrics.port": base, "rollout.workers": 2},
    )
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", base + 2))
        holder.listen()
        run = asyncrl("launch", "--role", "all", "--config", str(config), "--progress", "quiet")
    assert run.returncode == 2, run.stdout + run.stderr
    line = _one_line_error(run.stderr)
    assert f"metrics.port: 127.0.0.1:{base + 2} is already in use" in line, line
    assert f"on {base}..{base + 2}" in line, line
    assert not (tmp_path / "run").exists()
