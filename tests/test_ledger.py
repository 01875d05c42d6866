"""The trainer's durability ledger against a real Redis, without a model: entries are acked and
counted as trained only at `checkpointed`, a restart acks what the checkpoint covers on behalf
of consumers that may no longer exist, and nothing is counted twice."""

from __future__ import annotations

import redis

from asyncrl.queue import Consumer, Producer, QueueConfig
from asyncrl.redis_conn import RedisGuard
from asyncrl.runstate import TRAJECTORIES_GROUP, Counter, Keys
from asyncrl.trainer.ledger import Ledger, consumer_name
from asyncrl.trainer.parallel import Ranks

ONE_RANK = Ranks(rank=0, size=1, world=None)


def _consumer(client: redis.Redis, keys: Keys, name: str) -> Consumer[object]:
    return Consumer(
        client,
        keys.trajectories,
        TRAJECTORIES_GROUP,
        name,
        QueueConfig(),
        dlq=keys.dlq,
        counters_key=keys.counters,
        is_alive=lambda _: True,
        guard=RedisGuard(reconnect_max_s=0.2),
    )


def _ledger(client: redis.Redis, consumer: Consumer[object], **covered: list[str]) -> Ledger:
    return Ledger(
        consumer,  # type: ignore[arg-type]  # the ledger never decodes
        ONE_RANK,
        RedisGuard(reconnect_max_s=0.2),
        client,
        covered_at_restart=covered,
    )


def _read(consumer: Consumer[object], n: int) -> list[str]:
    ids = [d.id for d in consumer.read(n, block_ms=100)]
    assert len(ids) == n
    return ids


def _pending(client: redis.Redis, keys: Keys) -> dict[str, str]:
    rows = client.xpending_range(keys.trajectories, TRAJECTORIES_GROUP, "-", "+", 100)
    return {r["message_id"].decode(): r["consumer"].decode() for r in rows}


def _trained(client: redis.Redis, keys: Keys) -> int:
    return int(client.hget(keys.counters, Counter.GROUPS_TRAINED) or 0)


def test_entries_are_acked_only_once_checkpointed(redis_client: redis.Redis) -> None:
    keys = Keys("ledger1")
    producer = Producer(redis_client, keys.trajectories)
    for i in range(3):
        producer.add({"data": b"%d" % i})
    consumer = _consumer(redis_client, keys, consumer_name(0))
    ledger = _ledger(redis_client, consumer)
    ids = _read(consumer, 3)

    ledger.record(ids[:2])  # the third one's step has not run
    assert ledger.covered() == {"trainer-0": ids[:2]}
    assert set(_pending(redis_client, keys)) == set(ids)
    assert _trained(redis_client, keys) == 0

    ledger.checkpointed(ledger.settle)
    assert ledger.unacked == []
    assert set(_pending(redis_client, keys)) == {ids[2]}
    assert _trained(redis_client, keys) == 2

    ledger.checkpointed(ledger.settle)  # nothing recorded since: nothing acked
    assert _trained(redis_client, keys) == 2


def test_a_restart_acks_what_the_checkpoint_covers_once(redis_client: redis.Redis) -> None:
    keys = Keys("ledger2")
    producer = Producer(redis_client, keys.trajectories)
    for i in range(4):
        producer.add({"data": b"%d" % i})
    # The previous run: rank 0 and rank 1 trained two entries each, checkpointed, and died
    # before acking; rank 1 had acked one of its two already.
    rank0, rank1 = (_consumer(redis_client, keys, consumer_name(r)) for r in (0, 1))
    mine, theirs = _read(rank0, 2), _read(rank1, 2)
    rank1.settle(theirs[:1], Counter.GROUPS_TRAINED)
    assert _trained(redis_client, keys) == 1

    # The restart runs one rank: rank 0 acks for both, the acked entry is not counted again.
    restarted = _consumer(redis_client, keys, consumer_name(0))
    covered = {"trainer-0": mine, "trainer-1": theirs}
    ledger = _ledger(redis_client, restarted, **covered)
    ledger.ack_covered_at_restart()
    assert _pending(redis_client, keys) == {}
    assert _trained(redis_client, keys) == 4

    ledger.ack_covered_at_restart()  # a second restart from the same checkpoint
    assert _trained(redis_client, keys) == 4


def test_restart_after_redis_lost_the_group_acks_nothing(redis_client: redis.Redis) -> None:
    keys = Keys("ledger3")
    consumer = _consumer(redis_client, keys, "trainer-0")
    ledger = _ledger(redis_client, consumer, **{"trainer-0": ["1-0"]})
    ledger.ack_covered_at_restart()  # no stream, no group: NOGROUP is not an error
    assert _trained(redis_client, keys) == 0
