"""Worker heartbeats: a TTL'd key while the worker lives, gone on a clean stop or after the TTL."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import msgpack
import redis

from asyncrl.heartbeat import Heartbeat, is_alive
from asyncrl.launch.redis_server import RedisServer
from asyncrl.runstate import Keys, role_workers

HELPER = Path(__file__).with_name("queue_consumer_proc.py")
KEYS = Keys("hb")


def test_heartbeat_lists_the_worker_and_stop_removes_it(redis_client: redis.Redis) -> None:
    key = KEYS.worker("rollout", "w1")
    hb = Heartbeat(redis_client, key, ttl_s=3.0, status_fn=lambda: {"version": 7, "busy": True})
    with hb:
        assert 0 < redis_client.pttl(key) <= 3000
        status = msgpack.unpackb(redis_client.get(key))
        assert status["version"] == 7 and abs(status["ts"] - time.time()) < 2
        (worker,) = role_workers(redis_client, KEYS, "rollout")
        assert worker["id"] == "w1" and worker["version"] == 7 and worker["busy"] is True
        assert 0 <= worker["age_s"] < 2
        assert role_workers(redis_client, KEYS, "trainer") == []
        alive = is_alive(redis_client, KEYS, "rollout", cache_s=0)
        assert alive("w1") and not alive("w2")
        time.sleep(1.2)  # beats every ttl/3: the TTL is refreshed
        assert redis_client.pttl(key) > 2000
    assert not redis_client.exists(key)
    assert role_workers(redis_client, KEYS, "rollout") == []
    assert not alive("w1")


def test_status_failure_still_beats_and_bad_values_are_ignored(redis_client: redis.Redis) -> None:
    def broken() -> dict[str, object]:
        raise RuntimeError("status unavailable")

    with Heartbeat(redis_client, KEYS.worker("rollout", "w1"), ttl_s=2.0, status_fn=broken):
        # A pickle is never unpickled, and junk does not hide the well-formed workers.
        redis_client.set(KEYS.worker("rollout", "evil"), b"\x80\x04\x95\x00cos\nsystem\n.")
        redis_client.set(KEYS.worker("rollout", "list"), msgpack.packb([1, 2]))
        assert [w["id"] for w in role_workers(redis_client, KEYS, "rollout")] == ["w1"]


def test_killed_worker_heartbeat_expires_after_ttl(
    redis_server: RedisServer, redis_client: redis.Redis, tmp_path: Path
) -> None:
    key = KEYS.worker("rollout", "doomed")
    args = [
        redis_server.url,
        KEYS.prompts,
        "rollout",
        "doomed",
        key,
        "1.0",
        str(tmp_path / "log"),
        "0",
    ]
    env = {**os.environ, "PYTHONPATH": str(HELPER.parent.parent)}
    proc = subprocess.Popen([sys.executable, str(HELPER), *args], env=env)
    try:
        deadline = time.monotonic() + 20
        while not redis_client.exists(key):
            assert proc.poll() is None and time.monotonic() < deadline, "worker did not start"
            time.sleep(0.05)
        time.sleep(0.5)
        assert redis_client.exists(key)  # kept alive past half a TTL
    finally:
        proc.kill()
        proc.wait()
    killed_at = time.monotonic()
    while redis_client.exists(key):
        assert time.monotonic() - killed_at < 1.5, "heartbeat outlived its TTL"
        time.sleep(0.02)
    assert role_workers(redis_client, KEYS, "rollout") == []


def test_heartbeat_survives_redis_restart(redis_server: RedisServer) -> None:
    client = redis.Redis.from_url(redis_server.url, socket_timeout=2)
    key = KEYS.worker("trainer", "trainer-0")
    with Heartbeat(client, key, ttl_s=0.6):
        redis_server.stop()
        time.sleep(0.8)  # longer than the TTL: the key has expired when Redis comes back
        redis_server.start()
        deadline = time.monotonic() + 5
        while not client.exists(key):
            assert time.monotonic() < deadline, "heartbeat did not resume"
            time.sleep(0.05)
    assert not client.exists(key)
    client.close()
