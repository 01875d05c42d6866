"""Only released prompt groups are worked on, each trained at most once (`asyncrl.provenance`), and
the run accounting survives a Redis that comes back without its data.

Hostile entries are built with plain msgpack and redis-py, as any writer to the run's Redis could.
A real trainer process given a group of a prompt it never released, a group with no samples and a
real group added twice more trains none of them: each is dead-lettered with its reason and
counted `entries_rejected`, so admission releases no extra prompts. A real rollout worker refuses
a prompt nobody released. An `Admission` whose Redis restarted empty releases no burst.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
import redis

from asyncrl.launch.redis_server import RedisServer
from asyncrl.launch.status import collect_status
from asyncrl.protocol import TrajectoryGroup, decode_group, stream_fields
from asyncrl.provenance import group_id_of, trajectory_groups
from asyncrl.queue import Consumer
from asyncrl.runstate import TRAJECTORIES_GROUP, Counter, Keys, read_accounting
from asyncrl.trainer.admission import Admission, Cursor, load_cursor

from role_procs import (
    Role,
    RoleConfig,
    arithmetic_admission,
    pending_groups,
    pending_prompts,
    step_lines,
    stop_all,
    wait_until,
)
from sample_groups import make_group

PROMPT_IDS = np.array([1, 5, 6, 13, 7, 8, 14], "<i4").tobytes()


def trajectory(run: str, group_id: str, samples: int = 2) -> dict[str, bytes]:
    """The stream fields of a well-formed trajectory group, as any msgpack writer builds them."""
    sample = {
        "response_ids": np.array([4, 5, 2], "<i4").tobytes(),
        "logprobs": np.array([-0.5, -1.0, -0.1], "<f4").tobytes(),
        "versions": np.zeros(3, "<i4").tobytes(),
        "finish": "stop",
    }
    message = {
        "schema": 1,
        "run": run,
        "group_id": group_id,
        "prompt_id": f"p-{group_id}",
        "release_version": 0,
        "worker": "outsider",
        "created_at": 0.0,
        "finished_at": 0.0,
        "prompt_ids": PROMPT_IDS,
        "samples": [{**sample, "reward": float(i % 2)} for i in range(samples)],
    }
    return {"data": msgpack.packb(message), "schema": b"1", "min_version": b"0"}


def dead_letters(client: redis.Redis, keys: Keys) -> dict[str, str]:
    """Dead-lettered entry id → reason."""
    return {f[b"id"].decode(): f[b"reason"].decode() for _, f in client.xrange(keys.dlq)}


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_trainer_trains_no_unreleased_empty_or_duplicate_group(
    redis_client: redis.Redis, tmp_path: Path, role_config: RoleConfig
) -> None:
    keys, g, eta, steps = Keys("prov"), 2, 1, 2
    run_dir = tmp_path / "run"
    config = role_config(
        keys.run_id,
        {
            "weights.type": "store",
            "rollout.n": 2,
            "trainer.device": "cpu",
            "trainer.groups_per_step": g,
            "trainer.max_steps": steps,
            "trainer.checkpoint_every": 1,
            "trainer.eval_every": 0,
            "trainer.wait_timeout_s": 120,
            "algo.max_staleness": eta,
        },
    )
    trainer = Role("trainer", config, tmp_path / "trainer.log")
    try:
        wait_until(
            lambda: redis_client.xlen(keys.prompts) == (eta + 1) * g,
            240,
            "the first release",
            [trainer],
        )
        released = [i.decode() for i, _ in redis_client.xrange(keys.prompts)]
        real = [trajectory(keys.run_id, gid) for gid in released]
        # Junk first, so that a trainer without the checks would fill its steps with it.
        hostile = [
            trajectory(keys.run_id, "1-0"),  # a prompt never released
            trajectory(keys.run_id, "2-0", samples=0),  # no samples
        ]
        ids = [redis_client.xadd(keys.trajectories, f).decode() for f in hostile]
        real_ids = [redis_client.xadd(keys.trajectories, real[0]).decode()]
        # The real entry added twice more, as a writer retrying blindly would.
        ids += [redis_client.xadd(keys.trajectories, real[0]).decode() for _ in range(2)]
        real_ids += [redis_client.xadd(keys.trajectories, f).decode() for f in real[1:]]
        assert trainer.wait(300) == 0, trainer.tail()
    finally:
        stop_all([trainer])

    # Only the four real groups were trained: two steps of two groups each.
    lines = step_lines(run_dir)
    assert [(s["step"], s["groups"]) for s in lines] == [(1, g), (2, g)]
    assert not pending_groups(redis_client, keys)
    dlq = dead_letters(redis_client, keys)
    assert dlq == dict(zip(ids, ["unreleased", "malformed", "duplicate", "duplicate"], strict=True))
    assert not set(real_ids) & set(dlq)
    status = collect_status(redis_client, keys, run_dir)
    counters = status["counters"]
    assert counters[Counter.GROUPS_TRAINED] == steps * g
    assert counters[Counter.ENTRIES_REJECTED] == len(ids)
    assert counters[Counter.GROUPS_DEAD_LETTERED] == counters[Counter.GROUPS_DROPPED_STALE] == 0
    # Junk bought no releases: the budget of the last step's release, (1 + η + 1) × G.
    assert (
        counters[Counter.PROMPTS_RELEASED] == redis_client.xlen(keys.prompts) == (steps + eta) * g
    )
    assert status["in_flight"] == counters[Counter.PROMPTS_RELEASED] - steps * g
    assert status["balanced"], status


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_worker_refuses_a_prompt_nobody_released(
    redis_client: redis.Redis, random_model: Path, tmp_path: Path, role_config: RoleConfig
) -> None:
    keys = Keys("prov-w")
    config = role_config(
        keys.run_id,
        {
            "weights.type": "store",
            "rollout.n": 2,
            "rollout.sampling.max_new_tokens": 8,
        },
    )
    junk = {
        "schema": 1,
        "run": keys.run_id,
        "prompt_id": "junk",
        "prompt": "12+34=",
        "prompt_ids": b"",
        "answer": "46",
        "task": "arithmetic",
        "n": 2,
        "release_version": 0,
    }
    junk_id = redis_client.xadd(keys.prompts, {"data": msgpack.packb(junk), "schema": b"1"})
    admission = arithmetic_admission(redis_client, keys, random_model, n=2, max_staleness=0)
    assert admission.release(0, 0) == 1
    real_id = redis_client.xrange(keys.prompts)[-1][0].decode()
    worker = Role("rollout", config, tmp_path / "rollout.log", "--worker-id", "w0")
    try:
        wait_until(
            lambda: redis_client.xlen(keys.trajectories) + redis_client.xlen(keys.dlq) == 2,
            240,
            "both prompts handled",
            [worker],
        )
        assert worker.stop() == 0, worker.tail()
    finally:
        stop_all([worker])

    assert dead_letters(redis_client, keys) == {junk_id.decode(): "unreleased"}
    [(_, fields)] = redis_client.xrange(keys.trajectories)
    assert msgpack.unpackb(fields[b"data"])["group_id"] == real_id
    assert not pending_prompts(redis_client, keys)
    counters, in_flight = read_accounting(redis_client, keys)
    assert counters[Counter.ENTRIES_REJECTED] == 1
    assert counters[Counter.GROUPS_PUBLISHED] == counters[Counter.PROMPTS_RELEASED] == 1
    assert counters[Counter.GROUPS_DEAD_LETTERED] == 0
    assert in_flight == 1  # published, for the trainer to claim
    assert counters.is_balanced(in_flight)


class Items:
    """A train split whose prompt ids name their position."""

    def train_items(self, seed: int, epoch: int) -> list[Any]:
        from asyncrl.items import PromptItem

        return [PromptItem(f"e{epoch}p{i}", f"prompt {i}", [1, 3 + i], str(i)) for i in range(50)]

    def eval_items(self) -> list[Any]:
        return []

    def score(self, item: Any, response_text: str) -> float:
        return 0.0


@dataclass
class Lossy:
    """A Redis without persistence (killed, it comes back empty), admission over it with G = 2
    and η = 1, and the trainer's consumer, which admission asks what it holds."""

    server: RedisServer
    client: redis.Redis
    keys: Keys
    admission: Admission
    trainer: Consumer[TrajectoryGroup]

    def lose_data(self) -> None:
        self.server.kill()
        self.server.start()

    def read_groups(self, n: int) -> list[str]:
        """Answer the first `n` released prompts and have the trainer read the groups; their ids."""
        for group_id in [i.decode() for i, _ in self.client.xrange(self.keys.prompts, count=n)]:
            self.client.xadd(self.keys.trajectories, stream_fields(make_group(group_id)))
        return [d.id for d in self.trainer.read(count=n, block_ms=100)]


@pytest.fixture
def lossy(tmp_path: Path) -> Iterator[Lossy]:
    server = RedisServer(data_dir=tmp_path / "redis", appendonly=False).start()
    client = redis.Redis.from_url(server.url)
    keys = Keys("lost")
    trainer: Consumer[TrajectoryGroup] = Consumer(
        client,
        keys.trajectories,
        TRAJECTORIES_GROUP,
        "trainer-0",
        dlq=keys.dlq,
        counters_key=keys.counters,
        is_alive=lambda _: True,
        decode=lambda fields: decode_group(fields[b"data"]),
        groups=trajectory_groups(keys),
    )
    admission = Admission(
        client,
        keys,
        Items(),
        task_name="items",
        n=1,
        max_staleness=1,
        groups_per_step=2,
        cursor=Cursor(seed=0),
        held=trainer.held_groups,
    )
    try:
        yield Lossy(server, client, keys, admission, trainer)
    finally:
        client.close()
        server.stop()


def test_admission_after_redis_lost_its_data(
    lossy: Lossy, caplog: pytest.LogCaptureFixture
) -> None:
    g, eta = 2, 1
    client, keys, admission, trainer = lossy.client, lossy.keys, lossy.admission, lossy.trainer
    assert admission.release(0, 0) == (eta + 1) * g
    # The trainer reads two groups and trains them; the step's checkpoint (and its ack) is not
    # written yet when Redis loses its data.
    trained = lossy.read_groups(2)
    assert len(trained) == 2
    assert admission.release(1, 1) == g  # the bound: (1 + η + 1) × G released in all
    released_before = (eta + 2) * g

    lossy.lose_data()
    with caplog.at_level(logging.ERROR, logger="asyncrl.trainer.admission"):
        after = admission.release(1, 1)
    # In flight now: only what the trainer holds, which step 1 consumed: (η + 1) × G more.
    assert after == (eta + 1) * g
    assert admission.release(1, 1) == 0
    assert "Redis lost the run's state" in caplog.text
    counters, in_flight = read_accounting(client, keys)
    assert counters[Counter.PROMPTS_RELEASED] == released_before + after
    assert counters[Counter.GROUPS_LOST] == released_before - len(trained)
    assert in_flight == after + len(trained)
    assert counters.is_balanced(in_flight)
    # The step's checkpoint is written: its groups, gone with Redis, count as trained, once.
    assert trainer.settle(trained, Counter.GROUPS_TRAINED) == len(trained)
    assert trainer.settle(trained, Counter.GROUPS_TRAINED) == 0
    counters, in_flight = read_accounting(client, keys)
    assert counters[Counter.GROUPS_TRAINED] == len(trained)
    assert in_flight == after
    assert counters.is_balanced(in_flight)
    # The cursor goes on where it was: no prompt is released twice.
    assert load_cursor(client, keys, Cursor(seed=9)).position == released_before + after


def test_a_loss_right_after_a_settle_keeps_what_it_counted(lossy: Lossy) -> None:
    """Redis loses its data just after the trainer's checkpoint settled two groups, before any
    other read of the counters: the seed still counts them trained (admission remembers what
    it settled), so the lineage's count stays exact."""
    assert lossy.admission.release(0, 0) == 4
    ids = lossy.read_groups(2)
    settle = partial(lossy.trainer.settle, ids, Counter.GROUPS_TRAINED)
    assert lossy.admission.settle(lambda check: settle(check=check), Counter.GROUPS_TRAINED) == 2
    lossy.lose_data()
    # The two prompts never read are lost; nothing is in flight: (η + 1) × G go out.
    assert lossy.admission.release(1, 1) == 4
    counters, in_flight = read_accounting(lossy.client, lossy.keys)
    assert counters[Counter.GROUPS_TRAINED] == 2
    assert counters[Counter.GROUPS_LOST] == 2 and in_flight == 4
    assert counters.is_balanced(in_flight)


def test_a_loss_while_a_settle_waits_out_the_outage_counts_it_trained(lossy: Lossy) -> None:
    """Redis dies as the trainer's checkpoint settles two groups (after admission last read
    the counters) and comes back empty while the settle waits: the groups are found still held,
    kept in flight through the loss and counted trained, not lost."""
    assert lossy.admission.release(0, 0) == 4
    ids = lossy.read_groups(2)

    def settle(check: Callable[[], object]) -> int:
        lossy.server.kill()
        restart = threading.Timer(0.3, lossy.server.start)
        restart.start()
        try:
            return lossy.trainer.settle(ids, Counter.GROUPS_TRAINED, check=check)
        finally:
            restart.join()

    assert lossy.admission.settle(settle, Counter.GROUPS_TRAINED) == 2
    counters, in_flight = read_accounting(lossy.client, lossy.keys)
    assert counters[Counter.GROUPS_TRAINED] == 2
    # Only the two prompts never read are lost.
    assert counters[Counter.GROUPS_LOST] == 2 and in_flight == 0
    assert counters.is_balanced(in_flight)


def test_group_id_of_reads_only_the_head_of_a_message() -> None:
    head = {"schema": 1, "run": "r", "group_id": "5-0"}
    huge = msgpack.packb({**head, "samples": [{"response_ids": b"\0" * 2**20}]})
    assert group_id_of({b"data": huge}) == "5-0"
    assert group_id_of({b"data": huge[:100]}) == "5-0"  # truncated after the id
    late = msgpack.packb({"samples": [b"\0" * 8192], "group_id": "5-0"})
    assert group_id_of({b"data": late}) is None  # beyond the head: not searched
    ext = msgpack.packb({"group_id": msgpack.ExtType(1, b"x")})
    for data in (ext, msgpack.packb([1, 2]), msgpack.packb({"group_id": 5}), b"\xc1"):
        assert group_id_of({b"data": data}) is None
    assert group_id_of({b"schema": b"1"}) is None
    assert group_id_of(None) is None
