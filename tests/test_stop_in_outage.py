"""A rollout worker told to stop while Redis hangs leaves at once, and loses nothing.

The worker takes one batch of prompts and generates; Redis is frozen (SIGSTOP: connections are
accepted and never answered, the harshest outage) before the worker publishes, so it is stuck in
the ack that publishes its groups. SIGTERM then ends that wait: the worker exits cleanly instead
of waiting for Redis to return. Once Redis thaws, the prompts it held are still pending (or the
ack it sent last went through whole), and a restarted worker makes exactly one group per prompt.
"""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import msgpack
import pytest
import redis

from asyncrl.launch.redis_server import RedisServer
from asyncrl.launch.status import collect_status
from asyncrl.runstate import Counter, Keys
from asyncrl.trainer.checkpoint import list_checkpoints

from role_procs import (
    QUICK_TAKEOVER,
    SMALL_RUN,
    Role,
    RoleConfig,
    arithmetic_admission,
    pending_prompts,
    step_lines,
    stop_all,
    wait_until,
)

PROMPTS = 2  # one batch: the worker reads no more until it has published
N = 8
G = 2
# SIGTERM to exit: the attempt in flight ends at the socket timeout, then the heartbeat and the
# weight lease give up on Redis within one socket timeout each.
EXIT_BOUND_S = 20
# Calls to a hanging Redis fail within 2 s, and the roles retry at least every second.
HANGING_REDIS = {"redis.socket_timeout_s": 2.0, "redis.reconnect_max_s": 1.0}


def stops_on_sigterm(role: Role, what: str) -> None:
    """SIGTERM to `role`, which must exit 0 within EXIT_BOUND_S and print no traceback."""
    role.proc.send_signal(signal.SIGTERM)
    try:
        code = role.wait(EXIT_BOUND_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the {what} ignored SIGTERM for {EXIT_BOUND_S}s:\n{role.tail()}")
    assert code == 0, role.tail()
    assert "Traceback" not in role.tail(20_000)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_worker_stuck_acking_in_an_outage_obeys_sigterm(
    redis_server: RedisServer,
    redis_client: redis.Redis,
    random_model: Path,
    tmp_path: Path,
    role_config: RoleConfig,
) -> None:
    keys = Keys("stopout")
    config = role_config(
        keys.run_id,
        {
            **QUICK_TAKEOVER,
            **HANGING_REDIS,
            "rollout.n": N,
            "rollout.prompts_per_batch": PROMPTS,
            # An untrained model rarely stops early: 16 responses of 64 tokens take a while.
            "rollout.sampling.max_new_tokens": 64,
            "weights.type": "broadcast",
        },
    )
    admission = arithmetic_admission(
        redis_client, keys, random_model, n=N, max_staleness=PROMPTS - 1
    )
    logs = tmp_path / "logs"
    assert redis_server.proc is not None
    redis_pid = redis_server.proc.pid
    # Released before the worker starts, so that its first read takes the whole batch at once.
    assert admission.release(step=0, version=0) == PROMPTS
    released = [i.decode() for i, _ in redis_client.xrange(keys.prompts)]
    worker = Role("rollout", config, logs / "w.log", "--worker-id", "W")
    again: Role | None = None
    frozen = False
    try:
        wait_until(
            lambda: len(pending_prompts(redis_client, keys, "W")) == PROMPTS,
            240,
            "the worker taking its batch",
            [worker],
        )
        # The read ends with the script that checks the prompts were released; once it has run,
        # the worker's next Redis call is the publishing ack (its other threads run no script,
        # and it reads no more prompts while the batch is in flight).
        me = redis_client.client_id()
        wait_until(
            lambda: any(
                c["cmd"] == "evalsha" and int(c["id"]) != me for c in redis_client.client_list()
            ),
            60,
            "the worker admitting its batch",
            [worker],
        )
        os.kill(redis_pid, signal.SIGSTOP)
        frozen = True
        wait_until(
            lambda: f"ack on {keys.prompts}: Redis unreachable" in worker.tail(20_000),
            120,
            "the worker stuck publishing",
            [worker],
        )
        stops_on_sigterm(worker, "worker")
        assert "stopped while waiting for Redis" in worker.tail(20_000)
        os.kill(redis_pid, signal.SIGCONT)
        frozen = False

        # Nothing lost: under the same id, the worker gets back what it held.
        again = Role("rollout", config, logs / "again.log", "--worker-id", "W")
        wait_until(
            lambda: redis_client.xlen(keys.trajectories) >= PROMPTS,
            180,
            "the restarted worker publishing",
            [again],
        )
        assert again.stop() == 0, again.tail()
    finally:
        if frozen:
            os.kill(redis_pid, signal.SIGCONT)
        stop_all([worker, *([again] if again else [])])

    groups = [msgpack.unpackb(f[b"data"]) for _, f in redis_client.xrange(keys.trajectories)]
    assert sorted(g["group_id"] for g in groups) == sorted(released)  # one group per prompt
    status = collect_status(redis_client, keys, tmp_path / "run")
    assert status["counters"][Counter.GROUPS_PUBLISHED] == PROMPTS
    assert status["streams"]["prompts"]["lag"] == status["streams"]["prompts"]["pending"] == 0
    assert status["balanced"], status


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_trainer_told_to_stop_in_an_outage_leaves_and_resumes(
    redis_server: RedisServer, redis_client: redis.Redis, tmp_path: Path, role_config: RoleConfig
) -> None:
    """The same for the trainer: SIGTERM while Redis hangs, it leaves without its final ack —
    after writing its final checkpoint, or, stopped in the middle of a step (publishing its
    version), without one, as if killed. Restarted, it acks what its checkpoint covers and trains
    on, each step's groups of the surviving lineage counted trained once."""
    keys = Keys("stopout-t")
    run_dir = tmp_path / "run"
    config = role_config(
        keys.run_id,
        {
            **SMALL_RUN,
            **QUICK_TAKEOVER,
            **HANGING_REDIS,
            "trainer.groups_per_step": G,
            "trainer.checkpoint_every": 1000,  # only the final one: the step groups stay unacked
            # A send in flight when Redis froze ends within this, and the trainer's exit waits
            # for it (the publisher's close is bounded by a few sync timeouts).
            "weights.sync_timeout_s": 3.0,
        },
    )
    logs = tmp_path / "logs"
    assert redis_server.proc is not None
    redis_pid = redis_server.proc.pid
    trainer = Role("trainer", config, logs / "trainer.log")
    worker = Role("rollout", config, logs / "w.log", "--worker-id", "W")
    again: Role | None = None
    frozen = False
    try:
        wait_until(lambda: len(step_lines(run_dir)) >= 2, 180, "first steps", [trainer, worker])
        os.kill(redis_pid, signal.SIGSTOP)
        frozen = True
        wait_until(
            lambda: "Redis unreachable" in trainer.tail(20_000), 60, "an outage seen", [trainer]
        )
        stops_on_sigterm(trainer, "trainer")
        os.kill(redis_pid, signal.SIGCONT)
        frozen = False

        lines = len(step_lines(run_dir))
        again = Role("trainer", config, logs / "again.log")
        wait_until(
            lambda: len(step_lines(run_dir)) >= lines + 2,
            180,
            "steps after the restart",
            [again, worker],
        )
        assert worker.stop() == 0, worker.tail()
        assert again.stop() == 0, again.tail()
    finally:
        if frozen:
            os.kill(redis_pid, signal.SIGCONT)
        stop_all([worker, trainer, *([again] if again else [])])

    status = collect_status(redis_client, keys, run_dir)
    final = int(list_checkpoints(run_dir / "checkpoints")[-1].name.removeprefix("step_"))
    assert status["counters"][Counter.GROUPS_TRAINED] == final * G  # each step's groups once
    assert status["balanced"], status
