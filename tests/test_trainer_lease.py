"""One trainer per run (`asyncrl.lease`): a second trainer on a live run is refused, a trainer
whose lease another took stops before it publishes or acks anything more, and a dead trainer's
lease is taken over once it runs down."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import redis

from asyncrl.launch.status import collect_status
from asyncrl.lease import Lease, LeaseHeld, LeaseLost
from asyncrl.runstate import Counter, Keys
from asyncrl.trainer.checkpoint import list_checkpoints

from role_procs import Role, RoleConfig, step_lines, stop_all, wait_until

TTL_S = 2.0
FOREIGN = b"elsewhere:1:taken-over"
"""The token of a trainer that took the run after this one's lease expired."""


def _renewing(lease: Lease, stop: threading.Event) -> threading.Thread:
    """A live holder: renews every third of the TTL, as its heartbeat does."""

    def renew() -> None:
        while not stop.wait(TTL_S / 3):
            lease.hold()

    thread = threading.Thread(target=renew, daemon=True)
    thread.start()
    return thread


def test_a_live_holder_is_refused_and_a_dead_ones_lease_taken_over(
    redis_client: redis.Redis,
) -> None:
    key = Keys("lease").trainer_lease
    first = Lease(redis_client, key, TTL_S)
    first.acquire()
    stop = threading.Event()
    renewer = _renewing(first, stop)
    try:
        with pytest.raises(LeaseHeld, match="renewed while this one waited"):
            Lease(redis_client, key, TTL_S).acquire()
    finally:
        stop.set()
        renewer.join()
    assert redis_client.get(key) == first.token.encode()

    # The holder died (no more renewals, no release): its successor waits its lease out.
    second = Lease(redis_client, key, TTL_S)
    second.acquire()
    assert redis_client.get(key) == second.token.encode()
    assert not first.hold() and first.lost  # the dead one, were it to wake, is fenced off


def test_a_holder_whose_lease_was_taken_stops_for_good(redis_client: redis.Redis) -> None:
    key = Keys("taken").trainer_lease
    lost: list[bool] = []
    lease = Lease(redis_client, key, TTL_S, on_lost=lambda: lost.append(True))
    lease.acquire()
    redis_client.delete(key)  # expired in an outage, or a Redis that lost its data
    assert lease.hold()  # nobody else holds the run: taken again
    redis_client.set(key, FOREIGN, px=60_000)
    with pytest.raises(LeaseLost):
        lease.check()
    redis_client.delete(key)
    assert not lease.hold()  # lost for good, even once the key is free again
    assert lost == [True]
    lease.release()
    redis_client.set(key, FOREIGN)
    lease.release()
    assert redis_client.get(key) == FOREIGN  # never deletes another's lease


def _running(
    role_config: RoleConfig, logs: Path, run_dir: Path, run_id: str
) -> tuple[Path, Role, Role]:
    """The config, rollout worker and trainer of a long run, once it has trained 2 steps."""
    config = role_config(
        run_id,
        {
            "rollout.n": 4,
            "rollout.prompts_per_batch": 2,
            "rollout.heartbeat_ttl_s": TTL_S,
            "rollout.sampling.max_new_tokens": 16,
            "trainer.groups_per_step": 2,
            "trainer.max_steps": 1000,
            "trainer.checkpoint_every": 2,
            "trainer.eval_every": 0,
            "trainer.wait_timeout_s": 120,
            "algo.max_staleness": 2,
            "algo.filter_zero_variance": False,
            "weights.type": "store",
        },
    )
    worker = Role("rollout", config, logs / "rollout.log", "--worker-id", "w0")
    trainer = Role("trainer", config, logs / "trainer-1.log")
    try:
        wait_until(lambda: len(step_lines(run_dir)) >= 2, 240, "step 2", [worker, trainer])
    except BaseException:
        stop_all([worker, trainer])
        raise
    return config, worker, trainer


def _one_line_exit(role: Role, text: str) -> None:
    assert role.wait(180) == 2, role.tail()
    log = role.log.read_text()
    assert "Traceback" not in log, log[-3000:]
    last = log.strip().splitlines()[-1]
    assert last.startswith("asyncrl: trainer: run ") and text in last, last


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_second_trainer_on_a_live_run_is_refused(
    redis_client: redis.Redis, tmp_path: Path, role_config: RoleConfig
) -> None:
    """Two real trainer processes on one run: the second exits 2 with one line and touches
    nothing; the first goes on training, every step once, each version published once, nothing
    dead-lettered."""
    keys = Keys("two")
    run_dir, logs = tmp_path / "run", tmp_path / "logs"
    config, worker, first = _running(role_config, logs, run_dir, keys.run_id)
    second: Role | None = None
    try:
        second = Role("trainer", config, logs / "trainer-2.log")
        _one_line_exit(second, "a live trainer")
        refused_at = len(step_lines(run_dir))
        wait_until(
            lambda: len(step_lines(run_dir)) >= refused_at + 2, 240, "two steps more", [first]
        )
        worker.stop()
        assert first.stop() == 0, first.tail()
    finally:
        stop_all(r for r in (worker, first, second) if r is not None)

    steps = step_lines(run_dir)
    assert [s["step"] for s in steps] == list(range(1, len(steps) + 1))
    versions = [s["version"] for s in steps]
    assert versions == list(range(versions[0], versions[0] + len(steps)))
    assert redis_client.xlen(keys.dlq) == 0
    status = collect_status(redis_client, keys, run_dir)
    assert status["counters"][Counter.GROUPS_TRAINED] == len(steps) * 2
    assert status["balanced"], status
    assert redis_client.get(keys.trainer_lease) is None  # given back at the clean exit


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_trainer_whose_lease_was_taken_stops_before_publishing_more(
    redis_client: redis.Redis, tmp_path: Path, role_config: RoleConfig
) -> None:
    """The start-up check raced (or the trainer froze past its lease): another token holds the
    lease. The trainer stops with one line (exit 2), publishing at most the version it was
    already handing out and no checkpoint after that, and leaves the other's lease alone."""
    keys = Keys("fenced")
    run_dir = tmp_path / "run"
    _, worker, trainer = _running(role_config, tmp_path / "logs", run_dir, keys.run_id)
    try:
        redis_client.set(keys.trainer_lease, FOREIGN, px=600_000)
        version_then = int(redis_client.get(keys.version))  # type: ignore[arg-type]
        checkpoints_then = {p.name for p in list_checkpoints(run_dir / "checkpoints")}
        _one_line_exit(trainer, "another trainer took this run")
    finally:
        stop_all([worker, trainer])
    # A publish already past its check when the lease was taken may complete; nothing after it.
    assert int(redis_client.get(keys.version)) <= version_then + 1  # type: ignore[arg-type]
    steps_after = [s for s in step_lines(run_dir) if s["version"] > version_then]
    assert len(steps_after) <= 1, steps_after
    newer = {p.name for p in list_checkpoints(run_dir / "checkpoints")} - checkpoints_then
    assert len(newer) <= 1, newer
    assert redis_client.get(keys.trainer_lease) == FOREIGN
