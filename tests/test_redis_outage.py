"""Every role rides out Redis being unreachable, then carries on with nothing lost (DESIGN §9).

A trainer and a rollout worker train against a real Redis; Redis is stopped for `OUTAGE_S` (8 s:
beyond their capped backoff nothing in the roles depends on the length, so 30 s behave the same)
and started again on the same port and AOF. During the outage both processes stay alive,
wait without spinning (little CPU, a bounded number of log lines, among them a clear "unreachable"
line every few seconds) and report `asyncrl_redis_up 0` on /metrics; afterwards training goes on
and the run accounting balances with every trained group counted once.
"""

from __future__ import annotations

import os
import re
import time
import urllib.request
from collections import Counter
from pathlib import Path

import pytest
import redis

from asyncrl.launch.redis_server import RedisServer, free_port
from asyncrl.launch.status import collect_status
from asyncrl.runstate import Counter as RunCounter
from asyncrl.runstate import Keys
from asyncrl.trainer.checkpoint import list_checkpoints

from role_procs import Role, step_lines, stop_all, wait_until, write_role_config

OUTAGE_S = 8.0
G = 2
CLK_TCK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of process `pid` (all its threads), from /proc/PID/stat."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    fields = stat[stat.rindex(")") + 2 :].split()  # the name may hold spaces
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def redis_up(port: int) -> float | None:
    """The process' `asyncrl_redis_up` sample, or None if it has none."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
        text = reply.read().decode()
    match = re.search(r"^asyncrl_redis_up\{[^}]*\} (\S+)$", text, re.M)
    return float(match[1]) if match else None


@pytest.mark.slow
def test_roles_survive_a_redis_outage(random_model: Path, tmp_path: Path) -> None:
    server = RedisServer(data_dir=tmp_path / "redis").start()
    client = redis.Redis.from_url(server.url, socket_timeout=5)
    keys = Keys("outage")
    run_dir = tmp_path / "run"
    ports = [free_port(), free_port()]
    # Each role's metrics port is given on its command line, over the config's.
    config = write_role_config(
        tmp_path,
        server.url,
        random_model,
        keys.run_id,
        {
            "redis.reconnect_max_s": 2.0,
            "rollout.n": 2,
            "rollout.heartbeat_ttl_s": 3.0,
            "rollout.sampling.max_new_tokens": 4,
            "queue.claim_idle_s": 2.0,
            "trainer.groups_per_step": G,
            "trainer.max_steps": 10**6,
            "trainer.checkpoint_every": 2,
            "trainer.eval_every": 0,
            "weights.type": "broadcast",
            "weights.sync_timeout_s": 10.0,
        },
    )
    logs = tmp_path / "logs"
    trainer = Role("trainer", config, logs / "trainer.log", f"metrics.port={ports[0]}")
    worker = Role(
        "rollout", config, logs / "rollout.log", "--worker-id", "w0", f"metrics.port={ports[1]}"
    )
    roles = [trainer, worker]
    try:
        wait_until(lambda: len(step_lines(run_dir)) >= 3, 180, "first steps", roles)
        assert [redis_up(port) for port in ports] == [1, 1]
        steps_before = len(step_lines(run_dir))
        client.close()
        redis_port = server.port
        server.stop()
        log_sizes = [r.log.stat().st_size for r in roles]
        cpu_before = [cpu_seconds(r.proc.pid) for r in roles]
        started = time.monotonic()
        time.sleep(OUTAGE_S)
        cpu = [cpu_seconds(r.proc.pid) - c for r, c in zip(roles, cpu_before, strict=True)]
        for role in roles:
            assert role.alive(), f"{role.log.stem} died in the outage:\n{role.tail()}"
        outage_s = time.monotonic() - started
        assert [redis_up(port) for port in ports] == [0, 0]
        server.start()
        assert server.port == redis_port

        for role, used in zip(roles, cpu, strict=True):
            # Waiting means sleeping: a retry loop without backoff would burn a core.
            assert used < 0.25 * outage_s, f"{role.log.name} used {used:.1f}s CPU in the outage"
        for role, size in zip(roles, log_sizes, strict=True):
            with role.log.open("rb") as f:
                f.seek(size)
                lines = f.read().decode(errors="replace").splitlines()
            clear = [ln for ln in lines if "unreachable" in ln or "failing for" in ln]
            # Rate-limited: one line at the start, then one every 5 s.
            assert len(clear) >= 2, f"{role.log.name}: no clear outage line:\n" + "\n".join(lines)
            # The log records that repeat most, without their timestamps, if this fails.
            records = Counter(ln[24:] for ln in lines if ln[:4].isdigit())
            assert len(lines) <= 30, (role.log.name, len(lines), records.most_common(2))

        # Training goes on, from the same Redis data.
        client = redis.Redis.from_url(server.url, socket_timeout=5)
        wait_until(lambda: len(step_lines(run_dir)) >= steps_before + 3, 120, "steps after", roles)
        # The trainer may train groups it read ahead before the worker's backoff (up to
        # reconnect_max_s) has let it see Redis again.
        wait_until(lambda: [redis_up(port) for port in ports] == [1, 1], 30, "redis_up 1", roles)
        assert worker.stop() == 0, worker.tail()
        assert trainer.stop() == 0, trainer.tail()
        status = collect_status(client, keys, run_dir)
    finally:
        stop_all(roles)
        client.close()
        server.stop()

    assert status["balanced"], status
    final = list_checkpoints(run_dir / "checkpoints")[-1]
    # Each step of the lineage acked its groups once: none lost, none counted twice.
    assert (
        status["counters"][RunCounter.GROUPS_TRAINED] == int(final.name.removeprefix("step_")) * G
    )
    assert status["streams"]["dlq"]["length"] == 0
