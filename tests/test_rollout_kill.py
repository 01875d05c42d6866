"""A rollout worker SIGKILLed mid-generation loses no prompt (DESIGN §9).

Worker A takes a batch of prompts and is killed while generating (long responses keep it busy);
worker B takes over A's prompts once A's heartbeat has expired and they have been idle
`queue.claim_idle_s`. Every released prompt ends as exactly one trajectory group.
"""

from __future__ import annotations

import signal
from pathlib import Path

import msgpack
import pytest
import redis

from asyncrl.launch.status import collect_status
from asyncrl.runstate import Counter, Keys, read_counters

from role_procs import (
    QUICK_TAKEOVER,
    Role,
    RoleConfig,
    arithmetic_admission,
    pending_prompts,
    step_lines,
    stop_all,
    wait_until,
)

PROMPTS = 8
PER_BATCH = 4


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_killed_rollout_worker_loses_no_prompt(
    redis_client: redis.Redis, random_model: Path, tmp_path: Path, role_config: RoleConfig
) -> None:
    keys = Keys("rkill")
    config = role_config(
        keys.run_id,
        {
            **QUICK_TAKEOVER,
            "rollout.prompts_per_batch": PER_BATCH,
            # An untrained model rarely stops early: each batch is 4 × 16 responses of 64 tokens.
            "rollout.sampling.max_new_tokens": 64,
            "queue.claim_every_s": 0.2,
            "weights.type": "store",
        },
    )
    admission = arithmetic_admission(
        redis_client, keys, random_model, n=16, max_staleness=PROMPTS - 1
    )
    logs = tmp_path / "logs"
    a = Role("rollout", config, logs / "a.log", "--worker-id", "A")
    b = Role("rollout", config, logs / "b.log", "--worker-id", "B")
    try:
        # Both workers up and waiting on the stream, then the prompts: each takes a batch.
        wait_until(
            lambda: all(redis_client.exists(keys.worker("rollout", w)) for w in "AB"),
            180,
            "workers starting",
            [a, b],
        )
        assert admission.release(step=0, version=0) == PROMPTS
        released = [i.decode() for i, _ in redis_client.xrange(keys.prompts)]
        wait_until(
            lambda: bool(pending_prompts(redis_client, keys, "A")), 60, "A taking prompts", [a]
        )
        a.kill()
        held = pending_prompts(redis_client, keys, "A")
        # Killed mid-generation: it held a batch and had published nothing.
        assert len(held) == PER_BATCH
        assert not any(
            msgpack.unpackb(f[b"data"])["worker"] == "A"
            for _, f in redis_client.xrange(keys.trajectories)
        )
        wait_until(
            lambda: redis_client.xlen(keys.trajectories) >= PROMPTS,
            180,
            "B generating every prompt",
            [b],
        )
        b.stop()
    finally:
        stop_all([a, b])

    entries = redis_client.xrange(keys.trajectories)
    groups = [msgpack.unpackb(fields[b"data"]) for _, fields in entries]
    group_ids = [g["group_id"] for g in groups]
    assert len(group_ids) == PROMPTS  # one group per prompt: no duplicate
    assert sorted(group_ids) == sorted(released)
    by_id = {g["group_id"]: g for g in groups}
    for gid in held:
        assert by_id[gid]["worker"] == "B"
        assert len(by_id[gid]["lengths"]) == 16 * 4  # int32 per sample: the bulk layout
    assert "took over" in (logs / "b.log").read_text()

    status = collect_status(redis_client, keys, tmp_path / "run")
    assert status["counters"][Counter.GROUPS_PUBLISHED] == PROMPTS
    assert status["streams"]["prompts"]["lag"] == status["streams"]["prompts"]["pending"] == 0
    assert status["streams"]["dlq"]["length"] == 0
    assert status["balanced"], status


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_lone_worker_killed_and_restarted_under_its_id_lets_the_run_finish(
    redis_client: redis.Redis, tmp_path: Path, role_config: RoleConfig
) -> None:
    """The quickstart's shape: one worker, broadcast weights. Killed with groups queued, the
    worker's id is proposed the next version while its lease holds, never answers, and is left
    out; by the time its replacement (same id) starts, the trainer has trained every queued
    group and publishes nothing until it gets new ones. The replacement must get the current
    weights anyway, and the run reach `max_steps`."""
    g, max_steps = 2, 8
    keys = Keys("lone")
    run_dir = tmp_path / "run"
    config = role_config(
        keys.run_id,
        {
            **QUICK_TAKEOVER,
            "rollout.n": 2,
            "rollout.prompts_per_batch": 2,
            "rollout.sampling.max_new_tokens": 8,
            "trainer.groups_per_step": g,
            "trainer.max_steps": max_steps,
            "trainer.checkpoint_every": 1,
            "trainer.eval_every": 0,
            "trainer.wait_timeout_s": 120,
            "algo.max_staleness": 1,
            "algo.filter_zero_variance": False,
            "weights.type": "broadcast",
            "weights.sync_timeout_s": 5.0,
            # Outlives the restart: a version published after the kill is proposed to the dead
            # worker's id, which cannot answer.
            "weights.lease_s": 30.0,
        },
    )
    logs = tmp_path / "logs"
    trainer = Role("trainer", config, logs / "trainer.log")
    worker = Role("rollout", config, logs / "w0-1.log", "--worker-id", "w0")
    restarted: Role | None = None

    def counters() -> dict[str, int]:
        return read_counters(redis_client, keys)

    def weights(field: str) -> str | None:
        value = redis_client.hget(keys.weights, field)
        return None if value is None else value.decode()  # type: ignore[union-attr]

    try:
        wait_until(lambda: len(step_lines(run_dir)) >= 2, 240, "two steps", [trainer, worker])
        # Stopped, the trainer lets the worker catch up with every prompt released: then at
        # least one step's groups are queued, so a step (and its publish) follows the kill.
        trainer.proc.send_signal(signal.SIGSTOP)
        try:
            wait_until(
                lambda: (
                    counters()[Counter.GROUPS_PUBLISHED] == counters()[Counter.PROMPTS_RELEASED]
                ),
                60,
                "the worker publishing every released prompt",
                [worker],
            )
            worker.kill()
        finally:
            trainer.proc.send_signal(signal.SIGCONT)

        def idle_without_w0() -> bool:
            c, version = counters(), redis_client.get(keys.version)
            trained = g * len(step_lines(run_dir)) + c.get(Counter.GROUPS_DROPPED_STALE, 0)
            return (
                trained >= c[Counter.GROUPS_PUBLISHED]
                and version is not None
                and weights("sent_version") == version.decode()
                and weights("members") == "[]"
            )

        wait_until(
            idle_without_w0,
            120,
            "the trainer training every queued group and sending its version to no one",
            [trainer],
        )
        assert "no answer from ['w0']" in trainer.log.read_text()
        assert len(step_lines(run_dir)) < max_steps
        restarted = Role("rollout", config, logs / "w0-2.log", "--worker-id", "w0")
        wait_until(
            lambda: len(step_lines(run_dir)) >= max_steps,
            300,
            "the run finishing with the restarted worker",
            [trainer, restarted],
        )
        assert trainer.wait(60) == 0, trainer.tail()
        restarted.stop()
    finally:
        stop_all(r for r in (trainer, worker, restarted) if r is not None)
    assert [s["step"] for s in step_lines(run_dir)] == list(range(1, max_steps + 1))
