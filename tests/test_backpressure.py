"""Backpressure: with a trainer slower than its rollout workers, admission keeps the queues short
(DESIGN §5, §9).

The trainer is made slow by stopping it (SIGSTOP) for most of each cycle — a long step, a GC or
I/O stall — while two rollout workers run. Sampled every 0.1 s, the groups released and not yet
trained, dropped or dead-lettered never exceed admission's bound, (η + 1) × G with a checkpoint
after every step (otherwise up to `checkpoint_every` − 1 more steps of trained, not yet acked
groups). By the end of each stall the workers have taken every released prompt and wait, and
mostly the queue then sits at the bound — not always: a stall may catch the trainer between
acking a step and releasing the next prompts (admission runs in the trainer too). The streams'
lengths stay within the bound plus the entries acked since their last trim, which a consumer
does when it reads (at most every `queue.trim_every_s`, here always).

The other two kinds of backpressure have their own tests in tests/test_queue.py: producers pause
near Redis `maxmemory` (test_producer_pauses_under_memory_pressure_instead_of_raising), and
trimming never deletes an unacked entry (test_trim_never_deletes_pending_or_undelivered).
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest
import redis

from asyncrl.launch.status import collect_status
from asyncrl.runstate import PROMPTS_GROUP, Counter, Keys, stream_stats

from role_procs import SMALL_RUN, Role, RoleConfig, step_lines, stop_all, wait_until

G = 2
ETA = 1
CYCLES = 6
STALL_S = 2.0
# A stall lasts STALL_S, longer (up to this) while the workers are still generating on a loaded
# machine; well below the heartbeat TTL (10 s): a stalled trainer is slow, not dead.
MAX_STALL_S = 6.0
RUN_S = 0.5


def prompts_waiting(client: redis.Redis, keys: Keys) -> int:
    """Released prompts that no rollout worker has finished: undelivered plus delivered-unacked."""
    stats = stream_stats(client, keys.prompts, PROMPTS_GROUP)
    return stats["lag"] + stats["pending"]


def counters_and_lengths(client: redis.Redis, keys: Keys) -> tuple[int, int, int]:
    """(queued, len(prompts), len(trajectories)); queued = released − (trained + dropped +
    dead-lettered), from one atomic read of the counters."""
    c = {k.decode(): int(v) for k, v in client.hgetall(keys.counters).items()}
    done = (Counter.GROUPS_TRAINED, Counter.GROUPS_DROPPED_STALE, Counter.GROUPS_DEAD_LETTERED)
    queued = c[Counter.PROMPTS_RELEASED] - sum(c.get(k, 0) for k in done)
    return queued, client.xlen(keys.prompts), client.xlen(keys.trajectories)


@pytest.mark.slow
def test_a_slow_trainer_holds_the_queues_at_the_admission_bound(
    redis_client: redis.Redis, tmp_path: Path, role_config: RoleConfig
) -> None:
    keys = Keys("backpressure")
    run_dir = tmp_path / "run"
    config = role_config(
        keys.run_id,
        {
            **SMALL_RUN,
            "rollout.prompts_per_batch": 1,
            # Trim at every read: the lengths then show what the queue holds, not the trim lag
            # (the entries acked since the last trim, however many the throughput allows).
            "queue.trim_every_s": 0.01,
            "trainer.groups_per_step": G,
            "trainer.checkpoint_every": 1,
            "algo.max_staleness": ETA,
            "algo.filter_zero_variance": False,
            "weights.type": "store",
        },
    )
    logs = tmp_path / "logs"
    trainer = Role("trainer", config, logs / "trainer.log")
    workers = [Role("rollout", config, logs / f"w{i}.log", "--worker-id", f"w{i}") for i in (0, 1)]
    roles = [trainer, *workers]
    bound = (ETA + 1) * G
    samples: list[tuple[int, int, int]] = []
    at_stall_end: list[tuple[int, int, int]] = []
    waiting_at_stall_end: list[int] = []
    try:
        wait_until(lambda: len(step_lines(run_dir)) >= 2, 180, "first steps", roles)
        steps_before = len(step_lines(run_dir))
        for _ in range(CYCLES):
            trainer.proc.send_signal(signal.SIGSTOP)
            try:
                start = time.monotonic()
                while True:
                    samples.append(counters_and_lengths(redis_client, keys))
                    waiting = prompts_waiting(redis_client, keys)
                    elapsed = time.monotonic() - start
                    if elapsed > MAX_STALL_S or (elapsed > STALL_S and waiting == 0):
                        break
                    time.sleep(0.1)
                at_stall_end.append(samples[-1])
                waiting_at_stall_end.append(waiting)
            finally:
                trainer.proc.send_signal(signal.SIGCONT)
            end = time.monotonic() + RUN_S
            while time.monotonic() < end:
                samples.append(counters_and_lengths(redis_client, keys))
                time.sleep(0.1)
        steps = len(step_lines(run_dir)) - steps_before
        for role in workers:
            assert role.stop() == 0, role.tail()
        assert trainer.stop() == 0, trainer.tail()
    finally:
        stop_all(roles)

    assert steps >= CYCLES, "the trainer should step between its stalls"
    assert max(q for q, _, _ in samples) <= bound, samples
    # The workers wait on admission, not the other way: by the end of every stall they have
    # taken every released prompt, and mostly the queue is then full.
    assert waiting_at_stall_end == [0] * CYCLES, (waiting_at_stall_end, at_stall_end)
    assert sum(q == bound for q, _, _ in at_stall_end) > CYCLES // 2, at_stall_end
    # Each consumer trims when it reads; the trainer reads right after acking a step, so at
    # most that step's entries are acked and still in the stream.
    longest = max(max(p, t) for _, p, t in samples)
    assert longest <= bound + G, samples
    status = collect_status(redis_client, keys, run_dir)
    assert status["balanced"], status
