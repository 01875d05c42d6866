"""Delta sync against full sync, side by side: `tools/bench_scale.py --parts delta`.

For each learning rate, rounds alternate between two broadcast publishers in one trainer
process, each with its own receiver process (a `BroadcastSubscriber` staging into a
`TorchEngine` of `--engine-dtype`, as in the broadcast part): one sends every version in full,
the other with `weights.delta` on (anchor_every large, so that the rows show the steady state;
an anchor costs a full sync). Between rounds the fp32 masters take an Adam-like step: every
element moves by `lr` in a fixed direction (early Adam's |m / sqrt(v)| = 1), so the share of
elements whose engine value changes is what the learning rate makes it, and it accumulates as
it does in training. Figures per learning rate: wire bytes per sync of each, their ratio,
publish→held of each (medians), their ratio, how many versions went as deltas (the rest fell
back to full by themselves), and the trainer's blocking per publish.

    python tools/bench_delta.py [--words 141000000] [--lr 1e-6]

run alone, times each pass of a delta by itself (minimum of 3) on random bf16 weights (std 0.02)
whose fp32 masters moved by ±lr: where a delta's publish→held goes when the link is not the cost.
"""

from __future__ import annotations

import argparse
import os
import queue
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench_scale import MB, _processes, _wait_held, build_model, median


def _step(params: list[tuple[str, Any]], directions: list[Any], lr: float) -> None:
    for (_, p), d in zip(params, directions, strict=True):
        p.add_(d, alpha=lr)


def part_delta(args: argparse.Namespace) -> list[dict[str, Any]]:
    import redis
    import torch

    from asyncrl.launch.redis_server import RedisServer
    from asyncrl.runstate import Keys
    from asyncrl.trainer.backends import build_publisher
    from asyncrl.weights.base import SyncRecord, text
    from asyncrl.weights.config import BroadcastWeightsConfig
    from asyncrl.weights.fields import BroadcastDeltaFields

    model = build_model(args.size)
    params = [(n, p.detach()) for n, p in model.named_parameters()]
    g = torch.Generator().manual_seed(1)
    directions = [
        (torch.randint(0, 2, p.shape, generator=g, dtype=torch.int8) * 2 - 1).bfloat16()
        for _, p in params
    ]
    kinds = {"full": False, "delta": True}
    rows = []
    with tempfile.TemporaryDirectory() as tmp, RedisServer(data_dir=Path(tmp)) as server:
        client = redis.Redis.from_url(server.url)
        me = [sys.executable, os.path.abspath(sys.argv[0]), "--receiver", "--redis", server.url]
        me += ["--size", args.size, "--engine-dtype", args.engine_dtype, "--transport"]
        cmds = [[*me, "broadcast", "--worker", kind, "--run", f"delta-{kind}"] for kind in kinds]
        records: dict[str, queue.Queue[SyncRecord]] = {k: queue.Queue() for k in kinds}
        pubs = {}
        for kind, on in kinds.items():
            delta = BroadcastDeltaFields(enabled=on, anchor_every=10_000)
            cfg = BroadcastWeightsConfig(bucket_mb=args.bucket_mb, sync_timeout_s=300, delta=delta)
            keys = Keys(f"delta-{kind}")
            pubs[kind] = build_publisher(
                cfg, client, keys, device="cpu", on_record=records[kind].put
            )
        with _processes(cmds):
            for kind in kinds:
                keys = Keys(f"delta-{kind}")
                while not any(text(f) == f"join:{kind}" for f in client.hkeys(keys.weights)):
                    time.sleep(0.05)
            version = 0
            for lr in args.lrs:
                got: dict[str, list[tuple[float, int, bool, float]]] = {k: [] for k in kinds}
                for round_ in range(args.rounds + 1):
                    version += 1
                    _step(params, directions, lr)
                    for kind, pub in pubs.items():
                        start = time.perf_counter()
                        blocking_s = pub.publish(params, version)
                        _wait_held(client, kind, version)
                        held_s = time.perf_counter() - start
                        record = records[kind].get(timeout=300)
                        assert record.ok, record
                        if round_:  # the first round of each rate: warm-up (the delta's anchor)
                            got[kind].append((held_s, record.bytes_sent, record.delta, blocking_s))
                full_b = median([r[1] for r in got["full"]])
                delta_b = median([r[1] for r in got["delta"]])
                full_s = median([r[0] for r in got["full"]])
                delta_s = median([r[0] for r in got["delta"]])
                row = {
                    "size": args.size,
                    "engine": args.engine_dtype,
                    "lr": lr,
                    "full_mb": round(full_b / MB, 2),
                    "delta_mb": round(delta_b / MB, 3),
                    "bytes_ratio": round(delta_b / full_b, 4),
                    "full_s": round(full_s, 3),
                    "delta_s": round(delta_s, 3),
                    "time_ratio": round(delta_s / full_s, 3),
                    "deltas": f"{sum(r[2] for r in got['delta'])}/{len(got['delta'])}",
                    "blocking_s": round(median([r[3] for r in got["delta"]]), 4),
                }
                print(f"  {row}", file=sys.stderr)
                rows.append(row)
        for pub in pubs.values():
            pub.close()
    return rows


def passes(words: int, lr: float) -> dict[str, float]:
    """Milliseconds of each pass of a delta over `words` bf16 words, each timed alone."""
    import torch

    from asyncrl.weights import delta
    from asyncrl.weights.buckets import checksum

    g = torch.Generator().manual_seed(0)
    masters = torch.randn(words, generator=g) * 0.02
    old = masters.bfloat16().view(torch.uint8)
    step = torch.randint(0, 2, (words,), generator=g, dtype=torch.int8) * 2 - 1
    new = (masters + lr * step).bfloat16().view(torch.uint8)
    a, b = old.view(torch.int16), new.view(torch.int16)
    changed = a != b
    encoded = delta.encode(old, new, torch.int16, (0, 1))

    def best(run: Any) -> float:
        times = []
        for _ in range(3):
            start = time.perf_counter()
            run()
            times.append(time.perf_counter() - start)
        return round(min(times) * 1e3, 1)

    def apply() -> None:
        delta.apply(target, encoded)

    target = old.clone()  # applying the same delta again rewrites the same words
    return {
        "changed_fraction": round(float(changed.float().mean()), 4),
        "sampled_estimate_ms": best(lambda: delta._sampled_size(a, b)),
        "encode_ms": best(lambda: delta.encode(old, new, torch.int16, (0, 1))),
        "compare_ms": best(lambda: delta._changed(a, b)),
        "changed_indices_ms": best(lambda: delta._where(changed)),
        "apply_ms": best(apply),
        "checksum_ms": best(lambda: checksum(new)),
        "copy_ms": best(lambda: new.clone()),
    }


if __name__ == "__main__":
    import json

    parser = argparse.ArgumentParser(description="Each pass of a delta, timed alone.")
    parser.add_argument("--words", type=int, default=141_000_000, help="bf16 words (150 M: ~141 M)")
    parser.add_argument("--lr", type=float, default=1e-6)
    cli = parser.parse_args()
    print(json.dumps(passes(cli.words, cli.lr)))
