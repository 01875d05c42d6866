"""The trainer's reading thread against a real redis-server: read-ahead bounds, reads on demand,
acks on the thread, errors handed to the caller, prompt release at every spell."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from asyncrl.queue import RawFields
from asyncrl.trainer.prefetch import Prefetcher

from queue_helpers import GROUP, STREAM, add, consumer, counter
from role_procs import wait_until


def pending(client: redis.Redis) -> int:
    return int(client.xpending(STREAM, GROUP)["pending"])


@pytest.fixture
def closing(redis_client: redis.Redis) -> Iterator[list[Prefetcher[Any]]]:
    """Prefetchers to close after the test; the consumer group exists from the start."""
    redis_client.xgroup_create(STREAM, GROUP, id="0", mkstream=True)
    started: list[Prefetcher[Any]] = []
    yield started
    for p in started:
        p.close()


def test_read_ahead_fills_up_to_capacity(
    redis_client: redis.Redis, closing: list[Prefetcher[Any]]
) -> None:
    ids = add(redis_client, 10)
    p = Prefetcher(consumer(redis_client, "c"), read_ahead=4).start()
    closing.append(p)
    wait_until(lambda: pending(redis_client) == 4, 5.0, "4 read ahead")
    time.sleep(0.2)
    assert pending(redis_client) == 4  # no further than the capacity
    assert [d.id for d in p.take(3, 1.0)] == ids[:3]
    # refilled behind the take; pending counts a read before the thread has buffered it
    wait_until(lambda: pending(redis_client) == 7 and p.buffered() == 4, 5.0, "4 more buffered")
    assert [d.id for d in p.take(10, 1.0)] == ids[3:7]


def test_without_read_ahead_only_what_is_asked(
    redis_client: redis.Redis, closing: list[Prefetcher[Any]]
) -> None:
    ids = add(redis_client, 10)
    releases = 0

    def release() -> None:
        nonlocal releases
        releases += 1

    p = Prefetcher(consumer(redis_client, "c"), before_read=release)
    closing.append(p.start())
    time.sleep(0.5)
    assert pending(redis_client) == 0
    assert releases >= 2  # at every spell (50 ms), even with nothing to read
    assert [d.id for d in p.take(2, 1.0)] == ids[:2]
    time.sleep(0.2)
    assert pending(redis_client) == 2


def test_take_waits_for_new_entries_and_times_out(
    redis_client: redis.Redis, closing: list[Prefetcher[Any]]
) -> None:
    p = Prefetcher(consumer(redis_client, "c"), read_ahead=4).start()
    closing.append(p)
    t0 = time.monotonic()
    assert p.take(4, 0.3) == []
    assert time.monotonic() - t0 >= 0.3
    (entry,) = add(redis_client, 1)
    assert [d.id for d in p.take(4, 5.0)] == [entry]


def test_acks_run_on_the_thread_in_order(
    redis_client: redis.Redis, closing: list[Prefetcher[Any]]
) -> None:
    add(redis_client, 6)
    p = Prefetcher(consumer(redis_client, "c"), read_ahead=6).start()
    closing.append(p)
    got = []
    while len(got) < 6:
        got += p.take(6, 1.0)
    assert p.settle([got[0].id], "dropped", wait=False) is None
    assert p.settle([d.id for d in got[1:4]], "trained") == 3
    assert counter(redis_client, "dropped") == 1 and counter(redis_client, "trained") == 3
    assert pending(redis_client) == 2
    # Acked already: not applied twice.
    assert p.settle([got[1].id], "trained") == 0
    assert counter(redis_client, "trained") == 3


def test_close_applies_queued_acks_and_leaves_buffered_entries_pending(
    redis_client: redis.Redis, closing: list[Prefetcher[Any]]
) -> None:
    add(redis_client, 5)
    p = Prefetcher(consumer(redis_client, "c"), read_ahead=5).start()
    taken = p.take(2, 1.0)
    wait_until(lambda: pending(redis_client) == 5, 5.0, "5 pending")
    p.settle([d.id for d in taken], "trained", wait=False)
    p.close()
    assert counter(redis_client, "trained") == len(taken)
    assert pending(redis_client) == 5 - len(taken)


def test_a_failing_read_reaches_the_caller(
    redis_client: redis.Redis, closing: list[Prefetcher[Any]]
) -> None:
    def decode(fields: RawFields) -> Any:
        raise RuntimeError("decoder bug")

    add(redis_client, 1)
    p = Prefetcher(consumer(redis_client, "c", decode=decode), read_ahead=2).start()
    closing.append(p)
    with pytest.raises(RuntimeError, match="prefetch thread failed") as info:
        p.take(1, 5.0)
    assert "decoder bug" in str(info.value.__cause__)
    with pytest.raises(RuntimeError, match="prefetch thread failed"):
        p.settle(["0-1"], "trained")
