"""The queue tests' stream: a `Consumer`/`Producer` pair on fixed keys, and what they count."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import redis

from asyncrl.queue import Consumer, Producer, QueueConfig, RawFields
from asyncrl.redis_conn import RedisGuard

STREAM, GROUP, DLQ, COUNTERS = "q:s", "g", "q:dlq", "q:counters"


def consumer(
    client: redis.Redis,
    name: str,
    *,
    group: str = GROUP,
    alive: Callable[[str], bool] = lambda _: True,
    decode: Callable[[RawFields], Any] | None = None,
    decode_batch: Callable[[list[RawFields]], list[Any]] | None = None,
    should_stop: Callable[[], bool] | None = None,
    guard: RedisGuard | None = None,
    **cfg: Any,
) -> Consumer[Any]:
    """`guard`: the consumer's retry policy; without one, a quick one that `should_stop` ends."""
    return Consumer(
        client,
        STREAM,
        group,
        name,
        QueueConfig(**cfg),
        dlq=DLQ,
        counters_key=COUNTERS,
        is_alive=alive,
        decode=decode,
        decode_batch=decode_batch,
        guard=guard or RedisGuard(reconnect_max_s=0.2, should_stop=should_stop),
    )


def add(client: redis.Redis, n: int, start: int = 0) -> list[str]:
    producer = Producer(client, STREAM)
    return [producer.add({"n": str(i)}) for i in range(start, start + n)]


def counter(client: redis.Redis, name: str) -> int:
    return int(client.hget(COUNTERS, name) or 0)
