"""A consumer SIGKILLed while holding entries loses nothing: once its heartbeat has expired,
another consumer takes over exactly those entries, and never while it was alive."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import redis

from asyncrl.heartbeat import Heartbeat, is_alive
from asyncrl.launch.redis_server import RedisServer
from asyncrl.queue import Consumer, Producer, QueueConfig
from asyncrl.runstate import Counter, Keys

HELPER = Path(__file__).with_name("queue_consumer_proc.py")
REPO = HELPER.parent.parent
TTL_S = 1.0


def spawn_worker(url: str, keys: Keys, name: str, log: Path, count: int) -> subprocess.Popen[bytes]:
    args = [url, keys.prompts, "rollout", name, keys.worker("rollout", name), str(TTL_S)]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.Popen([sys.executable, str(HELPER), *args, str(log), str(count)], env=env)


def read_log(log: Path) -> list[dict[str, float | str]]:
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def test_killed_consumer_entries_go_to_exactly_one_other_consumer(
    redis_server: RedisServer, redis_client: redis.Redis, tmp_path: Path
) -> None:
    keys = Keys("kill")
    producer = Producer(redis_client, keys.prompts)
    ids = [producer.add({"n": str(i)}) for i in range(10)]
    log = tmp_path / "worker-a.jsonl"
    proc = spawn_worker(redis_server.url, keys, "worker-a", log, count=4)
    try:
        deadline = time.monotonic() + 20
        while len(read_log(log)) < 4:
            assert proc.poll() is None and time.monotonic() < deadline, "worker-a did not start"
            time.sleep(0.05)
        a_ids = [str(e["id"]) for e in read_log(log)]
        assert redis_client.exists(keys.worker("rollout", "worker-a"))

        cfg = QueueConfig(claim_idle_s=0.5, claim_every_s=0.05)
        alive = is_alive(redis_client, keys, "rollout", cache_s=0.05)
        b = Consumer(
            redis_client,
            keys.prompts,
            "rollout",
            "worker-b",
            cfg,
            dlq=keys.dlq,
            counters_key=keys.counters,
            is_alive=alive,
        )
        delivered: list[tuple[str, float, int]] = []

        def poll(seconds: float, until: int) -> None:
            end = time.monotonic() + seconds
            while time.monotonic() < end and len(delivered) < until:
                for d in b.read(count=10, block_ms=50):
                    delivered.append((d.id, time.time(), d.deliveries))
                    assert b.ack([d.id], counters={Counter.GROUPS_PUBLISHED: 1})

        with Heartbeat(redis_client, keys.worker("rollout", "worker-b"), TTL_S):
            # Three times claim_idle_s with worker-a alive: only the entries it does not hold.
            poll(1.5, until=11)
            assert {i for i, _, _ in delivered} == set(ids) - set(a_ids)
            assert proc.poll() is None

            proc.kill()
            proc.wait()
            killed_at = time.time()
            poll(10, until=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()

    taken = delivered[6:]
    assert sorted(i for i, _, _ in taken) == sorted(a_ids)
    assert all(deliveries == 2 for _, _, deliveries in taken)
    # Never handed to worker-b while worker-a was alive, and only after its heartbeat expired.
    assert all(t >= killed_at for _, t, _ in taken)
    assert not redis_client.exists(keys.worker("rollout", "worker-a"))
    # None lost, none twice.
    assert sorted(i for i, _, _ in delivered) == sorted(ids)
    assert redis_client.xpending(keys.prompts, "rollout")["pending"] == 0
    assert int(redis_client.hget(keys.counters, Counter.GROUPS_PUBLISHED) or 0) == 10
