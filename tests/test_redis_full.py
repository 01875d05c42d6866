"""Junk that fills Redis neither kills nor stalls the trainer.

Redis runs at `--maxmemory 30mb --maxmemory-policy noeviction` (as a deployment should: evicting
would silently drop queued entries). Before the trainer starts, an outsider adds fifteen 1 MB
junk entries to the trajectories stream with plain redis-py. The trainer dead-letters every one
— each dead letter keeping a bounded prefix of the junk, its size and digest, so the dead-letter
stream does not fill Redis a second time — acks them, memory comes back as the acked junk is
trimmed, and the trainer goes on to train on the rollout worker's real groups.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import redis

from asyncrl.launch.redis_server import RedisServer
from asyncrl.queue import QueueConfig
from asyncrl.runstate import Keys

from role_procs import SMALL_RUN, Role, step_lines, stop_all, wait_until, write_role_config

JUNK = 15
JUNK_BYTES = 2**20
MAXMEMORY_MB = 30


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_junk_filling_redis_is_dead_lettered_and_training_goes_on(
    random_model: Path, tmp_path: Path
) -> None:
    server = RedisServer(
        data_dir=tmp_path / "redis", appendonly=False, maxmemory_mb=MAXMEMORY_MB
    ).start()
    client = redis.Redis.from_url(server.url, socket_timeout=10)
    keys = Keys("full")
    run_dir = tmp_path / "run"
    config = write_role_config(
        tmp_path,
        server.url,
        random_model,
        keys.run_id,
        {**SMALL_RUN, "rollout.heartbeat_ttl_s": 3.0},
    )
    rng = random.Random(0)
    # 0xc1 is a byte msgpack never uses: whatever follows, the entry is malformed.
    junk = [b"\xc1" + rng.randbytes(JUNK_BYTES - 1) for _ in range(JUNK)]
    ids = [client.xadd(keys.trajectories, {"data": j}).decode() for j in junk]  # type: ignore[union-attr]
    logs = tmp_path / "logs"
    trainer = Role("trainer", config, logs / "trainer.log")
    worker = Role("rollout", config, logs / "rollout.log", "--worker-id", "w0")
    roles = [trainer, worker]
    try:
        wait_until(lambda: client.xlen(keys.dlq) >= JUNK, 180, "junk dead-lettered", roles)

        def memory_back() -> bool:
            info = client.info("memory")
            return int(info["used_memory"]) < 0.5 * int(info["maxmemory"])

        # The acked junk goes at the consumer's next trim (queue.trim_every_s).
        wait_until(memory_back, 120, "memory freed", roles)
        wait_until(lambda: len(step_lines(run_dir)) >= 3, 180, "training on real groups", roles)
        assert worker.stop() == 0, worker.tail()
        assert trainer.stop() == 0, trainer.tail()
        dead = [fields for _, fields in client.xrange(keys.dlq)]
    finally:
        stop_all(roles)
        client.close()
        server.stop()

    assert [d[b"id"].decode() for d in dead] == ids
    budget = QueueConfig().dead_letter_payload_bytes
    for d, j in zip(dead, junk, strict=True):
        assert d[b"reason"] == b"malformed"
        assert d[b"data"] == j[: budget - len(b"data")]  # a prefix, not the whole megabyte
        assert int(d[b"orig_bytes"]) == len(b"data") + JUNK_BYTES
    assert len({d[b"orig_sha256"] for d in dead}) == JUNK  # tells the entries apart
