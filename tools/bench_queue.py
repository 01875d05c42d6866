"""Queue throughput: asyncrl's Producer/Consumer against bare redis-py, with the codec beside it.

    python tools/bench_queue.py [--groups 256] [--rounds 5] [--batch 16] [--samples 16]
                                [--tokens 1024] [--codec]

One round pushes `groups` trajectory groups (asyncrl.protocol.stream_fields of a realistic group)
through the stream and out again: add each group, then read `batch` at a time and ack each batch.
- asyncrl: `Producer.add`, `Consumer.read`, `Consumer.ack` (with a `groups_trained` counter, as
  the trainer does: ownership check, XACK and HINCRBY in one transaction). With `--codec`, each
  entry is encoded from the group when added and decoded (validated) when read, as rollout
  workers and trainers do; without it the same encoded fields go in as they are.
- raw: `XADD`, `XREADGROUP`, `XACK` through plain redis-py calls, no checks, no counters.
Figures are medians over `rounds`. The redis-server is started here with AOF off: this measures
the queue and the client, not the disk. It also prints where a group's wall time goes in each
round, by call (µs a group, medians over rounds), and the median round trip of a PING: a
one-thread loop waits one round trip per add, and what the codec costs adds to that wait rather
than overlapping it. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import redis
from bench_codec import bench_codec, make_group  # a sibling: the script's folder is importable

from asyncrl.launch.redis_server import RedisServer
from asyncrl.protocol import TrajectoryGroup, ValidationError, decode_groups, stream_fields
from asyncrl.queue import Consumer, Producer, RawFields
from asyncrl.runstate import Counter

Fields = dict[str | bytes, bytes]
# Seconds spent in each call of a round, by name, summed over its groups.
Stages = dict[str, float]


def _timed(stages: Stages | None, name: str, since: float) -> float:
    """Add the time since `since` to `stages[name]`; now."""
    now = time.perf_counter()
    if stages is not None:
        stages[name] = stages.get(name, 0.0) + now - since
    return now


def asyncrl_round(
    client: redis.Redis,
    stream: str,
    fields: Fields,
    groups: int,
    batch: int,
    group: TrajectoryGroup | None = None,
    stages: Stages | None = None,
) -> None:
    """With `group`, each entry is encoded from it and decoded (validated) when read, a read's
    entries at once, as rollout workers and trainers do; else `fields` go as they are.
    `stages`: where the time went, by call."""
    producer = Producer(client, stream)

    def decode(entries: list[RawFields]) -> list[TrajectoryGroup | ValidationError]:
        t = time.perf_counter()
        out = decode_groups([f[b"data"] for f in entries])
        _timed(stages, "decode", t)
        return out

    consumer: Consumer[object] = Consumer(
        client,
        stream,
        "trainer",
        "trainer-0",
        dlq=f"{stream}:dlq",
        counters_key=f"{stream}:counters",
        is_alive=bool,
        decode_batch=None if group is None else decode,
    )
    for _ in range(groups):
        t = time.perf_counter()
        if group is not None:
            fields = stream_fields(group)
            t = _timed(stages, "encode", t)
        producer.add(fields)
        _timed(stages, "add", t)
    done = 0
    while done < groups:
        t = time.perf_counter()
        got = consumer.read(count=batch, block_ms=100)
        t = _timed(stages, "read", t)  # the decode's share is taken out after the round
        consumer.ack([d.id for d in got], counters={Counter.GROUPS_TRAINED: len(got)})
        _timed(stages, "ack", t)
        done += len(got)


def raw_round(
    client: redis.Redis,
    stream: str,
    fields: Fields,
    groups: int,
    batch: int,
    stages: Stages | None = None,
) -> None:
    client.xgroup_create(stream, "trainer", id="0", mkstream=True)
    entry: dict[Any, Any] = fields
    for _ in range(groups):
        t = time.perf_counter()
        client.xadd(stream, entry)
        _timed(stages, "add", t)
    done = 0
    while done < groups:
        t = time.perf_counter()
        reply: Any = client.xreadgroup(
            "trainer", "trainer-0", {stream: ">"}, count=batch, block=100
        )
        t = _timed(stages, "read", t)
        ids = [entry_id for entry_id, _ in reply[0][1]]
        client.xack(stream, "trainer", *ids)
        _timed(stages, "ack", t)
        done += len(ids)


Round = Callable[[redis.Redis, str, Fields, int, int, Stages], None]


def rate(
    client: redis.Redis, run: Round, fields: Fields, groups: int, batch: int, stages: Stages
) -> float:
    """Groups per second of one round on a fresh stream; `stages` gets its calls' times."""
    stream = f"bench:{run.__name__}"
    t0 = time.perf_counter()
    run(client, stream, fields, groups, batch, stages)
    elapsed = time.perf_counter() - t0
    client.delete(stream, f"{stream}:counters")
    return groups / elapsed


def round_trip_us(client: redis.Redis, n: int = 1000) -> float:
    """Median µs of a PING: the wait a one-thread loop pays per call, whatever it sends."""
    times = []
    for _ in range(n):
        t = time.perf_counter()
        client.ping()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e6


def per_group_us(rounds: list[Stages], groups: int) -> dict[str, float]:
    """µs a group of each call, medians over `rounds`; a read's decode is taken out of it."""
    for stages in rounds:
        stages["read"] -= stages.get("decode", 0.0)
    return {
        name: round(statistics.median(s[name] for s in rounds) / groups * 1e6, 1)
        for name in rounds[0]
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--codec", action="store_true", help="encode and decode in asyncrl's path")
    args = parser.parse_args()
    group = make_group(args.samples, args.tokens)

    codec = bench_codec(args.samples, args.tokens, repeats=300)
    fields = stream_fields(group)
    size = sum(len(v) for v in fields.values())
    print(f"codec: {json.dumps(codec)}")
    with tempfile.TemporaryDirectory() as tmp:
        server = RedisServer(data_dir=Path(tmp), appendonly=False).start()
        try:
            client = redis.Redis.from_url(server.url, socket_timeout=10)

            def codec_round(
                client: redis.Redis, stream: str, f: Fields, n: int, b: int, stages: Stages
            ) -> None:
                asyncrl_round(client, stream, f, n, b, group, stages)

            def plain_round(
                client: redis.Redis, stream: str, f: Fields, n: int, b: int, stages: Stages
            ) -> None:
                asyncrl_round(client, stream, f, n, b, None, stages)

            ours: Round = codec_round if args.codec else plain_round
            rates: dict[Round, list[float]] = {ours: [], raw_round: []}
            stages: dict[Round, list[Stages]] = {ours: [], raw_round: []}
            # One warm-up round each, then alternate so that drift in load hits both alike.
            for r in range(args.rounds + 1):
                for run, got in rates.items():
                    spent: Stages = {}
                    x = rate(client, run, fields, args.groups, args.batch, spent)
                    if r:
                        got.append(x)
                        stages[run].append(spent)
            ping_us = round_trip_us(client)
            client.close()
        finally:
            server.stop()
    asyncrl_s, raw_s = (statistics.median(rates[run]) for run in (ours, raw_round))
    print(
        f"{args.groups} groups of {size / 1e6:.2f} MB ({args.samples}×{args.tokens} tokens), "
        f"batch {args.batch}, median of {args.rounds}{', codec in asyncrl path' * args.codec}: "
        f"asyncrl {asyncrl_s:.0f} groups/s "
        f"({asyncrl_s * size / 1e6:.0f} MB/s), raw redis-py {raw_s:.0f} groups/s"
    )
    calls = {"asyncrl": per_group_us(stages[ours], args.groups)}
    calls["raw"] = per_group_us(stages[raw_round], args.groups)
    print(f"µs a group by call: {json.dumps(calls)}; PING round trip {ping_us:.0f} µs")
    print(
        json.dumps(
            {
                "encode_mb_s": codec["encode_mb_s"],
                "decode_mb_s": codec["decode_mb_s"],
                "asyncrl_groups_s": round(asyncrl_s, 1),
                "raw_groups_s": round(raw_s, 1),
                "ratio": round(asyncrl_s / raw_s, 3),
                "ping_us": round(ping_us, 1),
                "calls_us": calls,
            }
        )
    )


if __name__ == "__main__":
    main()
