"""The durable queue against a real redis-server: delivery, claims, dead-lettering, acks, trimming,
outages and backpressure."""

from __future__ import annotations

import hashlib
import threading
import time
from functools import partial
from pathlib import Path
from typing import Any, cast

import pytest
import redis

from asyncrl.launch.redis_server import RedisServer
from asyncrl.queue import Consumer, Producer, QueueConfig, RawFields, trim_acked
from asyncrl.redis_conn import RedisGuard, Stopped
from asyncrl.runstate import Counter, stream_stats

from queue_helpers import COUNTERS, DLQ, GROUP, STREAM, add, consumer, counter


def pending_ids(client: redis.Redis, group: str = GROUP) -> list[str]:
    return [p["message_id"].decode() for p in client.xpending_range(STREAM, group, "-", "+", 1000)]


def test_round_trip_and_ack(redis_client: redis.Redis) -> None:
    ids = add(redis_client, 3)
    c = consumer(redis_client, "c1")
    got = c.read(count=10, block_ms=100)
    assert [d.id for d in got] == ids
    assert [d.value[b"n"] for d in got] == [b"0", b"1", b"2"]
    assert all(d.deliveries == 1 for d in got)
    assert pending_ids(redis_client) == ids

    assert c.ack(ids[:2], counters={Counter.GROUPS_TRAINED: 2}) is True
    assert pending_ids(redis_client) == ids[2:]
    assert counter(redis_client, Counter.GROUPS_TRAINED) == 2
    # A second ack of the same ids is refused and changes nothing.
    assert c.ack(ids[:2], counters={Counter.GROUPS_TRAINED: 2}) is False
    assert counter(redis_client, Counter.GROUPS_TRAINED) == 2
    assert c.read(count=10, block_ms=50) == []


def test_restarted_consumer_gets_its_own_pending_entries_first(redis_client: redis.Redis) -> None:
    ids = add(redis_client, 3)
    first = consumer(redis_client, "worker-1")
    assert [d.id for d in first.read(count=2, block_ms=100)] == ids[:2]
    later = add(redis_client, 2, start=3)

    restarted = consumer(redis_client, "worker-1")
    again = restarted.read(count=10, block_ms=100)
    assert [d.id for d in again] == ids[:2]
    assert [d.deliveries for d in again] == [2, 2]
    assert [d.value[b"n"] for d in again] == [b"0", b"1"]
    assert [d.id for d in restarted.read(count=10, block_ms=100)] == [ids[2], *later]
    # Entries handed out by this object are not handed out again while it holds them.
    assert restarted.read(count=10, block_ms=50) == []


def test_producer_before_group_exists(redis_client: redis.Redis) -> None:
    ids = add(redis_client, 2)
    assert redis_client.xinfo_groups(STREAM) == []
    assert [d.id for d in consumer(redis_client, "c").read(count=10, block_ms=100)] == ids


def test_consumer_before_stream_exists(redis_client: redis.Redis) -> None:
    c = consumer(redis_client, "c")
    assert c.read(count=10, block_ms=50) == []
    assert redis_client.exists(STREAM)
    ids = add(redis_client, 1)
    assert [d.id for d in c.read(count=10, block_ms=100)] == ids


class ToyError(ValueError):
    def __init__(self, reason: str) -> None:
        super().__init__(f"{reason}: entry rejected")
        self.reason = reason


def toy_decode(fields: RawFields) -> int:
    if b"bad" in fields:
        raise ToyError(fields[b"bad"].decode())
    if b"junk" in fields:
        raise ValueError("not a number")
    if b"bug" in fields:
        raise KeyError("a bug in the decoder")
    return int(fields[b"n"])


def toy_decode_batch(reads: list[int], batch: list[RawFields]) -> list[Any]:
    """`toy_decode` of a read's entries at once, each value or its exception, as
    `asyncrl.protocol.decode_groups` returns them; counts its calls in `reads`."""
    reads.append(len(batch))
    out: list[Any] = []
    for fields in batch:
        try:
            out.append(toy_decode(fields))
        except Exception as exc:
            out.append(exc)
    return out


@pytest.mark.parametrize("batch", [False, True])
def test_decode_failure_dead_letters_entry_and_delivers_the_rest(
    redis_client: redis.Redis, batch: bool
) -> None:
    p = Producer(redis_client, STREAM)
    good1 = p.add({"n": "1"})
    bad = p.add({"bad": "length_mismatch", "id": "clash"})
    good2 = p.add({"n": "2"})
    junk = p.add({"junk": "x"})
    reads: list[int] = []
    decoders: dict[str, Any] = {"decode": toy_decode}
    if batch:
        decoders = {"decode_batch": partial(toy_decode_batch, reads)}
    c = consumer(redis_client, "c", **decoders)

    got = c.read(count=10, block_ms=100)
    assert [(d.id, d.value) for d in got] == [(good1, 1), (good2, 2)]
    assert reads == ([4] if batch else [])  # one call for the read's four entries
    assert pending_ids(redis_client) == [good1, good2]
    assert counter(redis_client, Counter.GROUPS_DEAD_LETTERED) == 2

    dead = {e[b"id"].decode(): e for _, e in redis_client.xrange(DLQ)}
    assert set(dead) == {bad, junk}
    assert dead[bad][b"reason"] == b"length_mismatch"
    assert dead[bad][b"stream"] == STREAM.encode()
    assert b"entry rejected" in dead[bad][b"detail"]
    assert dead[bad][b"bad"] == b"length_mismatch"
    assert dead[bad][b"orig.id"] == b"clash"  # an original field named like the metadata
    assert dead[junk][b"reason"] == b"decode_error"

    # A decoder bug is not mistaken for bad input: it surfaces, and the entry stays pending.
    bug = p.add({"bug": "1"})
    with pytest.raises(KeyError):
        c.read(count=10, block_ms=100)
    assert bug in pending_ids(redis_client)
    # A caller that carries on gets it again, until max_deliveries dead-letters it.
    for _ in range(QueueConfig().max_deliveries - 1):
        with pytest.raises(KeyError):
            c.read(count=10, block_ms=100)
    assert c.read(count=10, block_ms=50) == []
    assert redis_client.xrange(DLQ)[-1][1][b"reason"] == b"max_deliveries"


def test_entry_delivered_too_often_is_dead_lettered(redis_client: redis.Redis) -> None:
    (entry,) = add(redis_client, 1)
    for deliveries in (1, 2):
        (d,) = consumer(redis_client, "crashy", max_deliveries=2).read(count=1, block_ms=100)
        assert d.deliveries == deliveries
    # Third delivery (a third crash-restart): dead-lettered instead of handed out.
    assert consumer(redis_client, "crashy", max_deliveries=2).read(count=1, block_ms=50) == []
    ((_, dead),) = redis_client.xrange(DLQ)
    assert dead[b"reason"] == b"max_deliveries"
    assert dead[b"id"] == entry.encode()
    assert dead[b"n"] == b"0"
    assert pending_ids(redis_client) == []
    assert counter(redis_client, Counter.GROUPS_DEAD_LETTERED) == 1


def test_only_dead_consumers_entries_are_claimed(redis_client: redis.Redis) -> None:
    ids = add(redis_client, 2)
    alive = {"a", "b"}
    a = consumer(redis_client, "a")
    assert len(a.read(count=2, block_ms=100)) == 2
    b = consumer(redis_client, "b", alive=alive.__contains__, claim_idle_s=0.2, claim_every_s=0.01)

    time.sleep(
        0.3
    )  # idle beyond claim_idle_s, but "a" is alive: a trainer holding for a checkpoint
    assert b.read(count=10, block_ms=50) == []
    assert {p["consumer"] for p in redis_client.xpending_range(STREAM, GROUP, "-", "+", 10)} == {
        b"a"
    }

    alive.discard("a")
    taken = b.read(count=10, block_ms=50)
    assert [d.id for d in taken] == ids
    assert [d.deliveries for d in taken] == [2, 2]
    # The presumed-dead owner cannot commit any more: its ack is refused and adds nothing.
    assert (
        a.ack(ids, counters={Counter.GROUPS_PUBLISHED: 2}, also_add=[("q:out", {"x": "1"})])
        is False
    )
    assert counter(redis_client, Counter.GROUPS_PUBLISHED) == 0
    assert redis_client.xlen("q:out") == 0
    assert (
        b.ack(ids, counters={Counter.GROUPS_PUBLISHED: 2}, also_add=[("q:out", {"x": "1"})]) is True
    )
    assert counter(redis_client, Counter.GROUPS_PUBLISHED) == 2
    assert redis_client.xlen("q:out") == 1


def test_ack_with_also_add_and_counters_is_one_transaction(redis_client: redis.Redis) -> None:
    ids = add(redis_client, 2)
    c = consumer(redis_client, "worker")
    c.read(count=2, block_ms=100)
    adds: list[tuple[str, Any]] = [("q:traj", {"data": b"\x00" * 10}), ("q:traj", {"data": b"x"})]
    assert c.ack(ids, counters={Counter.GROUPS_PUBLISHED: 2, "tokens": 7}, also_add=adds) is True
    assert [e[b"data"] for _, e in redis_client.xrange("q:traj")] == [b"\x00" * 10, b"x"]
    assert counter(redis_client, Counter.GROUPS_PUBLISHED) == 2
    assert counter(redis_client, "tokens") == 7
    assert pending_ids(redis_client) == []


class DropReplyOnce(redis.Redis):
    """Loses the reply of the first script call, after (or before) Redis ran it."""

    ran_first: bool = True
    dropped = False

    def evalsha(self, *args: Any, **kwargs: Any) -> Any:
        if self.dropped:
            return super().evalsha(*args, **kwargs)
        if self.ran_first:
            super().evalsha(*args, **kwargs)  # a NOSCRIPT error here is not the drop yet
        self.dropped = True
        raise redis.ConnectionError("connection reset by peer")


@pytest.mark.parametrize("ran_first", [True, False])
def test_ack_retry_after_lost_reply_applies_once(
    redis_server: RedisServer, redis_client: redis.Redis, ran_first: bool
) -> None:
    ids = add(redis_client, 1)
    flaky = DropReplyOnce.from_url(redis_server.url)
    flaky.ran_first = ran_first
    outages: list[bool] = []
    guard = RedisGuard(reconnect_max_s=0.1, on_outage=outages.append)
    c = consumer(flaky, "w", alive=bool, guard=guard)
    c.read(count=1, block_ms=100)

    assert (
        c.ack(ids, counters={Counter.GROUPS_PUBLISHED: 1}, also_add=[("q:traj", {"g": "1"})])
        is True
    )
    assert flaky.dropped
    assert counter(redis_client, Counter.GROUPS_PUBLISHED) == 1
    assert redis_client.xlen("q:traj") == 1
    assert pending_ids(redis_client) == []
    assert outages == [True, False] and c.outages == 1
    flaky.close()


def test_trim_never_deletes_pending_or_undelivered(redis_client: redis.Redis) -> None:
    ids = add(redis_client, 10)
    assert trim_acked(redis_client, STREAM) == 0  # no group yet: everything awaits a consumer
    g1 = consumer(redis_client, "c1", group="g1")
    g2 = consumer(redis_client, "c2", group="g2")
    g1.read(count=6, block_ms=100)
    g1.ack(ids[:3])  # g1: 3..5 pending, 6..9 undelivered
    g2.read(count=2, block_ms=100)
    g2.ack(ids[:2])  # g2: nothing pending, 2..9 undelivered

    assert trim_acked(redis_client, STREAM) == 2
    assert [i.decode() for i, _ in redis_client.xrange(STREAM)] == ids[2:]
    assert trim_acked(redis_client, STREAM) == 0

    g2.ack([d.id for d in g2.read(count=10, block_ms=100)])
    g1.ack(ids[3:6])
    trim_acked(redis_client, STREAM)
    assert [i.decode() for i, _ in redis_client.xrange(STREAM)] == ids[6:]  # g1 has not read them
    g1.ack([d.id for d in g1.read(count=10, block_ms=100)])
    trim_acked(redis_client, STREAM)
    assert redis_client.xlen(STREAM) == 0


def test_stream_stats(redis_client: redis.Redis) -> None:
    assert stream_stats(redis_client, STREAM, GROUP) == {"length": 0, "lag": 0, "pending": 0}
    ids = add(redis_client, 5)
    c = consumer(redis_client, "c", group="other")
    c.read(count=1, block_ms=100)
    # The group does not exist yet: all entries are ahead of it.
    assert stream_stats(redis_client, STREAM, GROUP) == {"length": 5, "lag": 5, "pending": 0}
    c = consumer(redis_client, "c")
    c.read(count=2, block_ms=100)
    c.ack(ids[:1])
    assert stream_stats(redis_client, STREAM, GROUP) == {"length": 5, "lag": 3, "pending": 1}


def test_consumer_and_producer_survive_redis_restart(redis_server: RedisServer) -> None:
    client = redis.Redis.from_url(redis_server.url, socket_timeout=5)
    producer = Producer(client, STREAM, guard=RedisGuard(reconnect_max_s=0.1))
    outages: list[bool] = []
    guard = RedisGuard(reconnect_max_s=0.1, on_outage=outages.append)
    c = consumer(client, "c", alive=bool, guard=guard)
    delivered: list[str] = []
    values: list[bytes] = []
    acked = 0
    stop = threading.Event()

    def loop() -> None:
        nonlocal acked
        while not stop.is_set():
            for d in c.read(count=5, block_ms=100):
                delivered.append(d.id)
                values.append(d.value[b"n"])
                acked += c.ack([d.id], counters={Counter.GROUPS_TRAINED: 1})

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    try:
        add_ids = [producer.add({"n": str(i)}) for i in range(20)]
        redis_server.stop()  # graceful: the AOF is flushed
        restart = threading.Timer(0.6, redis_server.start)
        restart.start()
        t0 = time.monotonic()
        add_ids.append(producer.add({"n": "20"}))  # blocks until Redis is back
        assert time.monotonic() - t0 > 0.4
        restart.join()
        add_ids += [producer.add({"n": str(i)}) for i in range(21, 40)]
        deadline = time.monotonic() + 15
        while len(set(values)) < 40 and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        stop.set()
        thread.join(10)
    assert sorted(set(values), key=int) == [str(i).encode() for i in range(40)]
    assert len(delivered) == len(set(delivered))  # no entry handed out twice
    assert set(add_ids) <= set(delivered)
    assert counter(client, Counter.GROUPS_TRAINED) == acked == len(delivered)
    assert pending_ids(client) == []
    assert outages[:2] == [True, False] and c.outages >= 1 and producer.outages == 1
    client.close()


def test_threads_sharing_a_guard_count_one_outage(redis_server: RedisServer) -> None:
    """The trainer's reader thread and main loop share one guard: an outage both see is one
    outage, opened and closed once (the redis_up gauge follows `on_outage`)."""
    client = redis.Redis.from_url(redis_server.url, socket_timeout=5)
    events: list[bool] = []
    guard = RedisGuard(reconnect_max_s=0.05, on_outage=events.append)
    redis_server.stop()
    answered: list[bool] = []
    threads = [
        threading.Thread(target=lambda: answered.append(guard.call(client.ping, "ping")))
        for _ in range(4)
    ]
    for t in threads:
        t.start()
    time.sleep(0.5)  # every thread is now retrying
    assert guard.down and answered == []
    redis_server.start()
    for t in threads:
        t.join(15)
    assert answered == [True] * 4
    assert events == [True, False] and guard.outages == 1 and not guard.down
    client.close()


def fill_until_oom(client: redis.Redis, key: str, size: int) -> None:
    with pytest.raises(redis.exceptions.OutOfMemoryError):
        for _ in range(10_000):
            client.xadd(key, {"d": b"x" * size})


def test_producer_pauses_under_memory_pressure_instead_of_raising(tmp_path: Path) -> None:
    with RedisServer(data_dir=tmp_path, appendonly=False, maxmemory_mb=4) as server:
        client = redis.Redis.from_url(server.url)
        c = consumer(client, "c", trim_every_s=0.05)
        c.read(count=1, block_ms=10)  # creates the group, so trimming can follow the acks
        producer = Producer(client, STREAM, QueueConfig(memory_high_watermark=0.8))
        added: list[str] = []
        errors: list[BaseException] = []

        def produce() -> None:
            try:
                for i in range(120):  # 6 MB: well over maxmemory
                    added.append(producer.add({"n": str(i), "d": b"x" * 50_000}))
            except BaseException as exc:
                errors.append(exc)

        thread = threading.Thread(target=produce, daemon=True)
        thread.start()
        stalled_at = -1
        for _ in range(100):  # until the producer stops making progress
            before = len(added)
            time.sleep(0.3)
            if len(added) == before:
                stalled_at = before
                break
        assert 0 < stalled_at < 120 and not errors and thread.is_alive()

        consumed = 0
        deadline = time.monotonic() + 20
        while thread.is_alive() and time.monotonic() < deadline:
            got = c.read(count=20, block_ms=50)
            c.ack([d.id for d in got])
            consumed += len(got)
        thread.join(1)
        assert not errors and len(added) == 120
        while got := c.read(count=50, block_ms=50):
            c.ack([d.id for d in got])
            consumed += len(got)
        assert consumed == 120

        # A full Redis still takes plain acks: that is what lets consumers free it.
        entry = producer.add({"n": "last"})
        assert [d.id for d in c.read(count=1, block_ms=100)] == [entry]
        fill_until_oom(client, "q:ballast", 50_000)
        assert c.ack([entry], counters={Counter.GROUPS_TRAINED: 1}) is True
        assert counter(client, Counter.GROUPS_TRAINED) == 1

        # While it is full, should_stop ends a producer's wait with Stopped.
        stop = threading.Event()
        threading.Timer(0.3, stop.set).start()
        with pytest.raises(Stopped):
            Producer(client, STREAM, guard=RedisGuard(should_stop=stop.is_set)).add({"n": "x"})
        assert stop.is_set()
        client.close()


def fill_with_junk(client: redis.Redis, key: str) -> int:
    """Junk entries on `key` until Redis refuses more (big ones, then small ones, so that it is
    full to the last kilobyte); how many went in."""
    n = 0
    for size in (100_000, 1000):
        try:
            while True:
                client.xadd(key, {"junk": b"x" * size})
                n += 1
        except redis.exceptions.OutOfMemoryError:
            pass
    return n


def digest(fields: dict[bytes, bytes]) -> bytes:
    """`orig_sha256` as the queue documents it: names and values in order, each preceded by
    its length as 8 bytes big-endian."""
    h = hashlib.sha256()
    for part in (p for kv in fields.items() for p in kv):
        h.update(len(part).to_bytes(8, "big") + part)
    return h.hexdigest().encode()


def test_dead_letter_keeps_a_bounded_prefix_and_the_stream_is_capped(
    redis_client: redis.Redis,
) -> None:
    originals = [
        {b"bad": b"too_large", b"data": bytes([65 + i]) * 100_000, b"id": b"x"} for i in range(5)
    ]
    ids = [cast(bytes, redis_client.xadd(STREAM, dict(f))).decode() for f in originals]
    c = consumer(
        redis_client,
        "c",
        decode=toy_decode,
        dead_letter_payload_bytes=1000,
        dead_letter_max_entries=3,
    )
    assert c.read(count=10, block_ms=100) == []
    assert (
        counter(redis_client, Counter.GROUPS_DEAD_LETTERED) == 5 and pending_ids(redis_client) == []
    )

    dead = redis_client.xrange(DLQ)
    assert [e[b"id"].decode() for _, e in dead] == ids[2:]  # the newest 3
    for (_, e), original in zip(dead, originals[2:], strict=True):
        assert e[b"reason"] == b"too_large"
        # 1000 bytes of names and values: "bad" and its value whole, then a prefix of data.
        assert e[b"bad"] == b"too_large"
        assert e[b"data"] == original[b"data"][: 1000 - len(b"badtoo_largedata")]
        assert b"orig.id" not in e  # past the bound
        assert int(e[b"orig_bytes"]) == sum(len(k) + len(v) for k, v in original.items())
        assert e[b"orig_sha256"] == digest(original)


def test_dead_letters_free_a_full_redis(tmp_path: Path) -> None:
    """Junk fills Redis to maxmemory. The consumer still dead-letters all of it — the dead
    letters without the junk, or none where Redis refuses even those — and acks it, so trimming
    frees the memory; it does not wait for memory that only these acks can free."""
    with RedisServer(data_dir=tmp_path, appendonly=False, maxmemory_mb=4) as server:
        client = redis.Redis.from_url(server.url)
        give_up = time.monotonic() + 120  # a consumer waiting for memory fails the test
        c = consumer(
            client,
            "c",
            decode=toy_decode,
            should_stop=lambda: time.monotonic() > give_up,
            trim_every_s=0.05,
            dead_letter_payload_bytes=1000,
        )
        assert c.read(count=1, block_ms=10) == []  # creates the group
        junk = fill_with_junk(client, STREAM)
        while client.xlen(STREAM):
            assert c.read(count=50, block_ms=10) == []
        assert counter(client, Counter.GROUPS_DEAD_LETTERED) == junk and pending_ids(client) == []
        memory = client.info("memory")
        assert memory["used_memory"] < 0.9 * memory["maxmemory"]
        # Which dead letters Redis had room for depends on the order of acks and trims.
        dead = [e for _, e in client.xrange(DLQ)]
        assert len(dead) <= junk
        assert all(len(e.get(b"junk", b"")) <= 1000 - len(b"junk") for e in dead)

        # Room again: producers and consumers carry on.
        entry = Producer(client, STREAM).add({"n": "1"})
        assert [(d.id, d.value) for d in c.read(count=1, block_ms=100)] == [(entry, 1)]
        client.close()


def test_an_oom_inside_a_script_pauses_like_any_full_redis(tmp_path: Path) -> None:
    """Redis 6.2 reports a write refused for memory inside a script as a generic script error
    (`-OOM command not allowed ...`): the guard still sees a full Redis, pauses and retries."""
    with RedisServer(data_dir=tmp_path, appendonly=False, maxmemory_mb=4) as server:
        client = redis.Redis.from_url(server.url)
        fill_with_junk(client, "q:ballast")
        script = client.register_script("return redis.call('XADD', KEYS[1], '*', 'd', ARGV[1])")
        retries: list[bool] = []

        def free_memory(outage: bool) -> None:
            retries.append(outage)
            client.delete("q:ballast")

        RedisGuard().call(
            lambda: script(keys=["q:x"], args=["y" * 10_000]), "add", on_retry=free_memory
        )
        assert retries == [False]  # one pause for memory, not an outage
        assert client.xlen("q:x") == 1
        client.close()


def test_acks_after_redis_lost_its_data_are_not_applied(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Redis restarts empty (no AOF) under a consumer holding entries: its acks and dead
    letters of them apply nothing and raise nothing, the loss is logged once, and the next
    read recreates the group."""
    with RedisServer(data_dir=tmp_path, appendonly=False) as server:
        client = redis.Redis.from_url(server.url, socket_timeout=5)
        ids = add(client, 3)
        c = consumer(client, "w")
        held = c.read(count=3, block_ms=100)
        assert [d.id for d in held] == ids
        server.stop()
        server.start()

        assert c.ack(ids[:1], counters={Counter.GROUPS_TRAINED: 1}) is False
        assert c.ack(ids[1:2], also_add=[("q:traj", {"g": "1"})]) is False
        c.dead_letter(ids[2], held[2].fields, "malformed", "rejected")
        assert client.keys("*") == []  # nothing applied
        gone = [r for r in caplog.records if "is gone" in r.getMessage()]
        assert len(gone) == 1

        later = add(client, 2, start=3)
        assert [d.id for d in c.read(count=10, block_ms=100)] == later
        assert c.ack(later, counters={Counter.GROUPS_TRAINED: 2}) is True
        assert counter(client, Counter.GROUPS_TRAINED) == 2
        client.close()


def test_should_stop_ends_a_wait_not_a_call(redis_server: RedisServer) -> None:
    """A stopping consumer still reads and acks while Redis answers; once a call has to wait
    for Redis, should_stop ends it with Stopped, and what it did not ack stays pending."""
    client = redis.Redis.from_url(redis_server.url, socket_timeout=5)
    ids = add(client, 2)
    c = consumer(client, "w", should_stop=lambda: True)
    assert [d.id for d in c.read(count=2, block_ms=100)] == ids
    assert c.ack(ids[:1]) is True
    redis_server.stop()
    with pytest.raises(Stopped):
        c.ack(ids[1:])
    redis_server.start()
    assert pending_ids(client) == ids[1:]
    client.close()


def test_dead_letter_of_an_entry_with_many_fields(redis_client: redis.Redis) -> None:
    """An outsider's entry of 5000 fields: copied whole, it would overflow the Lua stack of the
    dead-letter transaction (the consumer would fail on every read); the dead letter keeps its
    first fields only."""
    fields = {b"junk": b"x", **{b"f%d" % i: b"v" for i in range(5000)}}
    entry = cast(bytes, redis_client.xadd(STREAM, dict(fields))).decode()
    c = consumer(redis_client, "c", decode=toy_decode)
    assert c.read(count=1, block_ms=100) == []
    ((_, dead),) = redis_client.xrange(DLQ)
    assert dead[b"id"].decode() == entry and dead[b"reason"] == b"decode_error"
    assert [k for k in dead if k.startswith(b"f")] == [b"f%d" % i for i in range(63)]
    assert int(dead[b"orig_bytes"]) == sum(len(k) + len(v) for k, v in fields.items())
    assert (
        pending_ids(redis_client) == [] and counter(redis_client, Counter.GROUPS_DEAD_LETTERED) == 1
    )


def test_add_counted_applies_once_while_the_counter_reads_what_was_read(
    redis_client: redis.Redis,
) -> None:
    producer = Producer(redis_client, STREAM, QueueConfig(max_message_bytes=8))
    add = partial(
        producer.add_counted,
        counters_key=COUNTERS,
        counter=Counter.PROMPTS_RELEASED,
        groups_key="q:open",
        state=("q:cursor", {"position": 2}),
    )
    assert add([{"n": "0"}, {"n": "1"}], expected=0) is True
    ids = [i.decode() for i, _ in redis_client.xrange(STREAM)]
    assert len(ids) == 2 and counter(redis_client, Counter.PROMPTS_RELEASED) == 2
    assert redis_client.hgetall("q:open") == {i.encode(): b"" for i in ids}
    assert redis_client.hgetall("q:cursor") == {b"position": b"2"}
    # A second attempt from the same read (a retry after a lost reply) applies nothing.
    assert add([{"n": "0"}, {"n": "1"}], expected=0) is False
    assert redis_client.xlen(STREAM) == 2 and counter(redis_client, Counter.PROMPTS_RELEASED) == 2
    with pytest.raises(ValueError, match="max_message_bytes"):
        add([{"n": "x" * 9}], expected=2)
    assert redis_client.xlen(STREAM) == 2


def test_add_counted_adds_nothing_to_a_full_redis_and_does_not_wait(tmp_path: Path) -> None:
    with RedisServer(data_dir=tmp_path, appendonly=False, maxmemory_mb=4) as server:
        client = redis.Redis.from_url(server.url)
        producer = Producer(client, STREAM)
        fill_until_oom(client, "q:ballast", 50_000)
        args = {"counters_key": COUNTERS, "counter": Counter.PROMPTS_RELEASED, "expected": 0}
        assert not producer.add_counted(
            [{"n": "0"}], **args, groups_key="q:open", state=("q:cursor", {"position": 1})
        )
        assert client.xlen(STREAM) == 0 and counter(client, Counter.PROMPTS_RELEASED) == 0
        assert client.hlen("q:open") == 0 and client.hlen("q:cursor") == 0
        client.close()


def test_drop_ends_its_group_and_counts_it_once(redis_client: redis.Redis) -> None:
    """`Consumer.drop` (a rollout worker giving up a group sure to be dropped stale): the entry
    acked, its open group ended and counted, no dead letter; dropping it again, or dropping an
    entry another consumer holds, changes nothing."""
    from asyncrl.queue import Groups

    released = "q:released"
    ids = add(redis_client, 2)
    redis_client.hset(released, mapping=dict.fromkeys(ids, ""))

    def held_by(name: str) -> Consumer[Any]:
        return Consumer(
            redis_client,
            STREAM,
            GROUP,
            name,
            QueueConfig(),
            dlq=DLQ,
            counters_key=COUNTERS,
            is_alive=lambda _: True,
            groups=Groups(released, lambda entry_id, fields, value: entry_id, claims=False),
        )

    worker = held_by("worker")
    assert [d.id for d in worker.read(count=2, block_ms=100)] == ids
    stale = Counter.GROUPS_DROPPED_STALE
    assert worker.drop(ids[0], stale) is True
    assert pending_ids(redis_client) == ids[1:] and counter(redis_client, stale) == 1
    assert not redis_client.hexists(released, ids[0]) and redis_client.hexists(released, ids[1])
    assert redis_client.xlen(DLQ) == 0
    assert worker.drop(ids[0], stale) is False  # acked already
    assert held_by("other").drop(ids[1], stale) is False  # not its entry
    assert counter(redis_client, stale) == 1 and pending_ids(redis_client) == ids[1:]
    assert redis_client.hexists(released, ids[1])
