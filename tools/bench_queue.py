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
the queue and the client, not the disk. The last line is one JSON object.
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
from asyncrl.protocol import TrajectoryGroup, decode_groups, stream_fields
from asyncrl.queue import Consumer, Producer
from asyncrl.runstate import Counter

Fields = dict[str | bytes, bytes]


def asyncrl_round(
    client: redis.Redis,
    stream: str,
    fields: Fields,
    groups: int,
    batch: int,
    group: TrajectoryGroup | None = None,
) -> None:
    """With `group`, each entry is encoded from it and decoded (validated) when read, a read's
    entries at once, as rollout workers and trainers do; else `fields` go as they are."""
    producer = Producer(client, stream)
    consumer: Consumer[object] = Consumer(
        client,
        stream,
        "trainer",
        "trainer-0",
        dlq=f"{stream}:dlq",
        counters_key=f"{stream}:counters",
        is_alive=bool,
        decode_batch=None if group is None else lambda b: decode_groups([f[b"data"] for f in b]),
    )
    for _ in range(groups):
        producer.add(fields if group is None else stream_fields(group))
    done = 0
    while done < groups:
        got = consumer.read(count=batch, block_ms=100)
        consumer.ack([d.id for d in got], counters={Counter.GROUPS_TRAINED: len(got)})
        done += len(got)


def raw_round(client: redis.Redis, stream: str, fields: Fields, groups: int, batch: int) -> None:
    client.xgroup_create(stream, "trainer", id="0", mkstream=True)
    entry: dict[Any, Any] = fields
    for _ in range(groups):
        client.xadd(stream, entry)
    done = 0
    while done < groups:
        reply: Any = client.xreadgroup(
            "trainer", "trainer-0", {stream: ">"}, count=batch, block=100
        )
        ids = [entry_id for entry_id, _ in reply[0][1]]
        client.xack(stream, "trainer", *ids)
        done += len(ids)


Round = Callable[[redis.Redis, str, Fields, int, int], None]


def rate(client: redis.Redis, run: Round, fields: Fields, groups: int, batch: int) -> float:
    """Groups per second of one round on a fresh stream."""
    stream = f"bench:{run.__name__}"
    t0 = time.perf_counter()
    run(client, stream, fields, groups, batch)
    elapsed = time.perf_counter() - t0
    client.delete(stream, f"{stream}:counters")
    return groups / elapsed


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

            def codec_round(client: redis.Redis, stream: str, f: Fields, n: int, b: int) -> None:
                asyncrl_round(client, stream, f, n, b, group)

            ours: Round = codec_round if args.codec else asyncrl_round
            rates: dict[Round, list[float]] = {ours: [], raw_round: []}
            # One warm-up round each, then alternate so that drift in load hits both alike.
            for r in range(args.rounds + 1):
                for run, got in rates.items():
                    x = rate(client, run, fields, args.groups, args.batch)
                    if r:
                        got.append(x)
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
    print(
        json.dumps(
            {
                "encode_mb_s": codec["encode_mb_s"],
                "decode_mb_s": codec["decode_mb_s"],
                "asyncrl_groups_s": round(asyncrl_s, 1),
                "raw_groups_s": round(raw_s, 1),
                "ratio": round(asyncrl_s / raw_s, 3),
            }
        )
    )


if __name__ == "__main__":
    main()
