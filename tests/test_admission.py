"""Admission control under arbitrary interleavings (DESIGN §5, §9), against a real Redis.

A simulated trainer (reads, drops stale groups, dead-letters bad ones, steps, checkpoints, crashes
and restarts from its last checkpoint) and two simulated rollout workers (taking and publishing
prompts at their own pace) run the real `Admission`, `Consumer` and counters in an order drawn by
hypothesis. At every moment:

- prompts released − (groups consumed by steps + dropped + dead-lettered) ≤ (η + 1) × G, where a
  step rolled back by a crash still counts (its groups are pending again, not released again),
  and no release ever raises the excess over the trainer's *current* step above the bound;
- run accounting balances (released = trained + dropped + dead-lettered + in flight), with the
  released groups tracked as the roles track them (`asyncrl.provenance`);
- the released prompts are exactly the task's items in cursor order — epoch after epoch, across
  restarts of `Admission` from Redis — so none is released twice and none is skipped.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from asyncrl.items import PromptItem
from asyncrl.launch.redis_server import RedisServer
from asyncrl.protocol import ValidationError, decode_prompt
from asyncrl.provenance import prompt_groups
from asyncrl.queue import Consumer, Delivery, Groups, QueueConfig, RawFields
from asyncrl.runstate import (
    PROMPTS_GROUP,
    TRAJECTORIES_GROUP,
    Counter,
    Keys,
    read_accounting,
    read_counters,
    stream_depths,
)
from asyncrl.trainer.admission import Admission, Cursor, load_cursor

ITEMS_PER_EPOCH = 5  # small, so a run crosses many epochs
SEED = 7
CHECKPOINT_EVERY = 2
# No trimming (the test reads the whole prompts stream back) and no take-overs (nobody dies).
QUEUE = QueueConfig(trim_every_s=1e9, claim_every_s=1e9)


class FakeTask:
    """A train split whose prompt ids name their (epoch, position)."""

    def train_items(self, seed: int, epoch: int) -> Sequence[PromptItem]:
        return [
            PromptItem(f"s{seed}e{epoch}p{i}", f"prompt {i}", [1, 3 + i], str(i))
            for i in range(ITEMS_PER_EPOCH)
        ]

    def eval_items(self) -> Sequence[PromptItem]:
        return []

    def score(self, item: PromptItem, response_text: str) -> float:
        return 0.0


def decode_trajectory(fields: dict[bytes, bytes]) -> bytes:
    if fields[b"kind"] == b"bad":
        raise ValidationError("malformed", "simulated bad entry")
    return fields[b"kind"]


def trajectory_group(entry_id: str, fields: RawFields | None, value: Any) -> str | None:
    """A simulated trajectory names its prompt's entry id (its group) in `group`."""
    return fields[b"group"].decode() if fields else None


@dataclass
class Sim:
    client: redis.Redis
    keys: Keys
    eta: int
    g: int
    step: int = 0
    max_step: int = 0
    collected: int = 0
    unacked: list[str] = field(default_factory=list)
    ckpt_step: int = 0
    ckpt_cursor: dict[str, int] = field(default_factory=lambda: Cursor(seed=SEED).as_dict())
    held: dict[int, list[Delivery[Any]]] = field(default_factory=dict)
    restarts: int = 0

    def __post_init__(self) -> None:
        self.workers = [
            self._consumer(
                self.keys.prompts, PROMPTS_GROUP, f"w{i}", groups=prompt_groups(self.keys)
            )
            for i in (0, 1)
        ]
        self.held = {0: [], 1: []}
        self._start_trainer()

    def _consumer(
        self, stream: str, group: str, name: str, decode: Any = None, groups: Any = None
    ) -> Consumer[Any]:
        return Consumer(
            self.client,
            stream,
            group,
            name,
            QUEUE,
            dlq=self.keys.dlq,
            counters_key=self.keys.counters,
            is_alive=lambda _: True,
            decode=decode,
            groups=groups,
        )

    def _start_trainer(self) -> None:
        """A (re)started trainer: state of its last checkpoint, cursor from Redis when there."""
        self.step = self.ckpt_step
        self.collected = 0
        self.unacked = []
        self.trainer = self._consumer(
            self.keys.trajectories,
            TRAJECTORIES_GROUP,
            "trainer-0",
            decode_trajectory,
            Groups(self.keys.released, trajectory_group, claims=True),
        )
        self.admission = Admission(
            self.client,
            self.keys,
            FakeTask(),
            task_name="fake",
            n=2,
            max_staleness=self.eta,
            groups_per_step=self.g,
            cursor=load_cursor(self.client, self.keys, Cursor(**self.ckpt_cursor)),
        )

    # -- actions -------------------------------------------------------------------------------

    def release(self) -> None:
        before = read_counters(self.client, self.keys).get(Counter.PROMPTS_RELEASED, 0)
        self.admission.release(self.step, version=self.step)
        c = read_counters(self.client, self.keys)
        if c.get(Counter.PROMPTS_RELEASED, 0) > before:
            freed = c.get(Counter.GROUPS_DROPPED_STALE, 0) + c.get(Counter.GROUPS_DEAD_LETTERED, 0)
            assert (
                c[Counter.PROMPTS_RELEASED] - (self.step * self.g + freed)
                <= (self.eta + 1) * self.g
            )

    def take(self, worker: int, count: int) -> None:
        self.held[worker] += self.workers[worker].read(count, block_ms=0)

    def publish(self, worker: int, count: int, kind: str) -> None:
        batch, self.held[worker] = self.held[worker][:count], self.held[worker][count:]
        if batch:
            self.workers[worker].ack(
                [d.id for d in batch],
                also_add=[(self.keys.trajectories, {"kind": kind, "group": d.id}) for d in batch],
                counters={Counter.GROUPS_PUBLISHED: len(batch)},
            )

    def train(self, count: int) -> None:
        """What `Trainer._collect` does: release, read, drop stale, collect; step when full."""
        self.release()
        for d in self.trainer.read(min(count, self.g - self.collected), block_ms=0):
            if d.value == b"stale":
                assert self.trainer.ack([d.id], counters={Counter.GROUPS_DROPPED_STALE: 1})
                continue
            self.collected += 1
            self.unacked.append(d.id)
        if self.collected == self.g:
            self.step += 1
            self.max_step = max(self.max_step, self.step)
            self.collected = 0
            if self.step % CHECKPOINT_EVERY == 0:
                self.checkpoint()

    def checkpoint(self) -> None:
        """Durable state, then the ack of the groups its steps trained on (never a partial
        step's groups: those stay pending)."""
        self.ckpt_step = self.step
        self.ckpt_cursor = self.admission.cursor.as_dict()
        trained = self.unacked[: len(self.unacked) - self.collected]
        if trained:
            assert self.trainer.ack(trained, counters={Counter.GROUPS_TRAINED: len(trained)})
        self.unacked = self.unacked[len(trained) :]

    def crash(self) -> None:
        self.restarts += 1
        self._start_trainer()

    # -- invariants ----------------------------------------------------------------------------

    def check(self) -> None:
        c = read_counters(self.client, self.keys)
        freed = c.get(Counter.GROUPS_DROPPED_STALE, 0) + c.get(Counter.GROUPS_DEAD_LETTERED, 0)
        released = c.get(Counter.PROMPTS_RELEASED, 0)
        assert released - (self.max_step * self.g + freed) <= (self.eta + 1) * self.g
        counters, in_flight = read_accounting(self.client, self.keys)
        assert counters.is_balanced(in_flight), (counters, in_flight)
        # Without junk, the groups in flight are exactly the entries the streams still hold.
        streams = stream_depths(self.client, self.keys)
        queued = sum(streams[s]["lag"] + streams[s]["pending"] for s in ("prompts", "trajectories"))
        assert in_flight == queued, (in_flight, streams)
        assert int(self.client.xlen(self.keys.prompts)) == released

    def released_prompt_ids(self) -> list[str]:
        entries = self.client.xrange(self.keys.prompts)
        return [decode_prompt(fields[b"data"]).prompt_id for _, fields in entries]


ACTION = st.one_of(
    st.tuples(st.just("release")),
    st.tuples(st.just("take"), st.integers(0, 1), st.integers(1, 6)),
    st.tuples(
        st.just("publish"),
        st.integers(0, 1),
        st.integers(1, 6),
        st.sampled_from(["ok", "ok", "ok", "stale", "bad"]),
    ),
    st.tuples(st.just("train"), st.integers(1, 6)),
    st.tuples(st.just("crash")),
)


@settings(
    max_examples=50,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    eta=st.integers(0, 3),
    g=st.integers(1, 4),
    actions=st.lists(ACTION, min_size=1, max_size=60),
)
def test_admission_bound_and_cursor(
    redis_client: redis.Redis, eta: int, g: int, actions: list[tuple[Any, ...]]
) -> None:
    redis_client.flushdb()
    sim = Sim(redis_client, Keys("adm"), eta, g)
    for action in actions:
        getattr(sim, action[0])(*action[1:])
        sim.check()
    # Then everyone works steadily: the trainer gets past the furthest step it ever reached.
    target = sim.max_step + 2
    for _ in range(100):
        if sim.step >= target:
            break
        for w in (0, 1):
            sim.take(w, 6)
            sim.publish(w, 6, "ok")
        sim.train(6)
        sim.check()
    assert sim.step >= target, "the run stalled"
    sim.checkpoint()
    sim.check()

    released = sim.released_prompt_ids()
    expected = [
        f"s{SEED}e{k // ITEMS_PER_EPOCH}p{k % ITEMS_PER_EPOCH}" for k in range(len(released))
    ]
    assert released == expected
    assert len(released) >= sim.step * g
    c = read_counters(redis_client, sim.keys)
    trained = c.get(Counter.GROUPS_TRAINED, 0)
    assert trained == sim.ckpt_step * g  # every surviving step's groups, counted once


def test_release_into_a_full_redis_releases_nothing_and_keeps_the_cursor(tmp_path: Path) -> None:
    """The trainer's reads are what frees a full Redis: a release must not wait for it."""
    with RedisServer(data_dir=tmp_path, appendonly=False, maxmemory_mb=4) as server:
        client = redis.Redis.from_url(server.url)
        keys = Keys("full")
        admission = Admission(
            client,
            keys,
            FakeTask(),
            task_name="fake",
            n=2,
            max_staleness=0,
            groups_per_step=2,
            cursor=Cursor(seed=SEED),
        )
        with pytest.raises(redis.exceptions.OutOfMemoryError):
            for _ in range(10_000):
                client.xadd("ballast", {"d": b"x" * 50_000})
        assert admission.release(0, 0) == 0
        assert admission.cursor_dict() == Cursor(seed=SEED).as_dict()
        assert client.xlen(keys.prompts) == 0 and read_counters(client, keys).prompts_released == 0
        client.delete("ballast")
        assert admission.release(0, 0) == 2
        assert admission.cursor_dict() == {"seed": SEED, "epoch": 0, "position": 2}
        assert [decode_prompt(f[b"data"]).prompt_id for _, f in client.xrange(keys.prompts)] == [
            f"s{SEED}e0p0",
            f"s{SEED}e0p1",
        ]
        client.close()
