"""The run's state as `asyncrl.runstate` reads it: counters, accounting, version, workers."""

from __future__ import annotations

from dataclasses import fields

import redis

from asyncrl.heartbeat import Heartbeat
from asyncrl.runstate import (
    PROMPTS_GROUP,
    Counter,
    Counters,
    Keys,
    live_workers,
    read_accounting,
    read_counters,
    read_version,
    stream_depths,
)

KEYS = Keys("rs")


def test_counter_values_are_the_hash_fields_and_metric_outcomes() -> None:
    # The one place the names are spelled out: they are Redis's field names and `status --json`
    # keys, a public surface that this pins.
    assert [c.value for c in Counter] == [
        "prompts_released",
        "groups_published",
        "groups_trained",
        "groups_dropped_stale",
        "groups_dead_lettered",
        "groups_lost",
        "entries_rejected",
    ]
    assert [f.name for f in fields(Counters)] == [c.value for c in Counter]
    assert [c.outcome for c in Counter] == [
        "released",
        "published",
        "trained",
        "dropped_stale",
        "dead_lettered",
        "lost",
        "rejected",
    ]


def test_counters_record() -> None:
    raw = {Counter.PROMPTS_RELEASED.encode(): b"9", Counter.GROUPS_TRAINED.encode(): b"4"}
    c = Counters.from_hash({**raw, b"other": b"1"})
    assert c.prompts_released == 9 and c.groups_trained == 4 and c.groups_lost == 0
    assert c == dict.fromkeys(Counter, 0) | {Counter.PROMPTS_RELEASED: 9, Counter.GROUPS_TRAINED: 4}
    assert c[Counter.GROUPS_TRAINED] == 4 and c.get("other", -1) == -1
    more = c.plus(Counter.GROUPS_DROPPED_STALE, 2).plus(Counter.GROUPS_LOST.value, 1)
    assert (more.ended, more.freed) == (7, 3) and c.groups_dropped_stale == 0
    assert more.is_balanced(2) and not more.is_balanced(3)
    assert more.as_dict()[Counter.GROUPS_LOST] == 1 and len(more) == len(Counter)


def test_readers(redis_client: redis.Redis) -> None:
    assert read_counters(redis_client, KEYS) == Counters()
    assert read_version(redis_client, KEYS) is None
    redis_client.hset(KEYS.counters, mapping={Counter.PROMPTS_RELEASED: 3})
    redis_client.hset(KEYS.released, mapping={"1-0": "", "2-0": "", "3-0": ""})
    redis_client.set(KEYS.version, 7)
    counters, in_flight = read_accounting(redis_client, KEYS)
    assert counters.prompts_released == 3 and in_flight == 3 and counters.is_balanced(in_flight)
    assert read_version(redis_client, KEYS) == 7
    redis_client.xadd(KEYS.prompts, {"data": b"x"})
    redis_client.xgroup_create(KEYS.prompts, PROMPTS_GROUP, id="0")
    assert stream_depths(redis_client, KEYS) == {
        "prompts": {"length": 1, "lag": 1, "pending": 0},
        "trajectories": {"length": 0, "lag": 0, "pending": 0},
        "dlq": {"length": 0},
    }
    with Heartbeat(redis_client, KEYS.worker("rollout", "w1"), 5, lambda: {"version": 7}):
        workers = live_workers(redis_client, KEYS)
    assert [(w["id"], w["version"]) for w in workers["rollout"]] == [("w1", 7)]
    assert workers["trainer"] == []
