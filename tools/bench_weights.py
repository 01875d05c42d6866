"""Weight-sync throughput: asyncrl's broadcast against a raw torch.distributed broadcast.

    .venv/bin/python tools/bench_weights.py [--mb 100] [--rounds 8] [--bucket-mb 64]

Starts an embedded redis-server, the publisher in this process and two receivers (this script
with --receiver), all on CPU with gloo. Each round first publishes a version of an N-MiB model
through asyncrl — staging copy, Redis announcement, header, layout, buckets, checksum — and waits
until both receivers hold it; then it broadcasts one flat uint8 tensor of the same size with
`broadcast` over a raw gloo group of the same three processes, built the same way
(`device.new_group` on the publisher's TCPStore, its own prefix). Both are timed on the sender,
from start to completion. The first round (group forming, first-touch allocations) is a warm-up;
the figures are medians of the others. The last line is JSON:
{"mb", "asyncrl_mb_s", "raw_mb_s", "ratio", "send_s", "blocking_s"}.

    .venv/bin/python tools/bench_weights.py --lora [--hidden 768] [--layers 4] [--lora-rank 8]

instead syncs a random Qwen2 model (≥ 50 M parameters, fp32, from a config) through asyncrl's
broadcast twice, side by side in one run: every parameter (a full fine-tune), then only the
adapter of `model.lora` (rank `--lora-rank` on every projection). The JSON line holds, for each,
the bytes per sync, the median sync seconds and trainer blocking, and the bytes' ratio.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import queue
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import redis
import torch
import torch.distributed as dist

from asyncrl.launch.redis_server import RedisServer
from asyncrl.rollout.backends import build_subscriber
from asyncrl.runstate import Keys
from asyncrl.trainer.backends import build_publisher
from asyncrl.weights.base import SyncRecord, WeightPublisher, text
from asyncrl.weights.config import BroadcastWeightsConfig
from asyncrl.weights.groups import Group, local_addr_towards, new_group

RUN = "bench"
KEYS = Keys(RUN)
RECEIVERS = 2
TIMEOUT = timedelta(seconds=60)


def held_key(worker: str) -> str:
    return f"{KEYS.prefix}bench:held:{worker}"


def raw_group(client: redis.Redis, rank: int) -> Group:
    """A plain gloo group of publisher + receivers on the publisher's TCPStore."""
    while (master := client.hget(KEYS.weights, "master")) is None:
        time.sleep(0.05)
    host, port = text(master).rsplit(":", 1)
    store = dist.TCPStore(host, int(port), is_master=False, timeout=TIMEOUT)
    prefixed = dist.PrefixStore("bench/raw", store)
    cpu = torch.device("cpu")
    return new_group(
        "gloo", prefixed, rank, RECEIVERS + 1, TIMEOUT, cpu, local_addr_towards(host, int(port))
    )


def raw_broadcast(group: Group, flat: torch.Tensor) -> float:
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    start = time.perf_counter()
    group.broadcast([flat], opts).wait()
    return time.perf_counter() - start


def make_model(mb: int) -> dict[str, torch.Tensor]:
    """Like an LLM's parameters: 4-MiB matrices, alternately bf16 and fp32."""
    g = torch.Generator().manual_seed(0)
    return {
        f"layers.{i:03d}.weight": (
            torch.randn(1024, 1024, generator=g)
            if i % 2
            else torch.randn(1024, 2048, generator=g).bfloat16()
        )
        for i in range(mb // 4)
    }


def receiver(args: argparse.Namespace) -> None:
    client = redis.Redis.from_url(args.redis)
    stopping = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stopping.set())

    def on_weights(tensors: dict[str, torch.Tensor], version: int) -> None:
        client.set(held_key(args.worker), version)

    sub = build_subscriber(
        BroadcastWeightsConfig(), client, KEYS, args.worker, device="cpu", on_weights=on_weights
    )
    if args.rounds:  # none with --lora: no raw comparison
        group = raw_group(client, args.rank)
        flat = torch.empty(args.nbytes, dtype=torch.uint8)
        for _ in range(args.rounds):
            raw_broadcast(group, flat)
    stopping.wait()
    sub.close()


def wait_held(client: redis.Redis, version: int) -> None:
    for i in range(RECEIVERS):
        while client.get(held_key(f"r{i}")) != str(version).encode():
            time.sleep(0.002)


@contextlib.contextmanager
def running(
    args: argparse.Namespace, nbytes: int, raw_rounds: int
) -> Iterator[tuple[redis.Redis, queue.Queue[SyncRecord], WeightPublisher]]:
    """An embedded Redis, the publisher and the receivers, all joined; `raw_rounds` raw
    broadcasts of `nbytes` each follow on the receivers' side."""
    with tempfile.TemporaryDirectory() as tmp, RedisServer(data_dir=Path(tmp)) as server:
        client = redis.Redis.from_url(server.url)
        records: queue.Queue[SyncRecord] = queue.Queue()
        cfg = BroadcastWeightsConfig(bucket_mb=args.bucket_mb, sync_timeout_s=60)
        pub = build_publisher(cfg, client, KEYS, device="cpu", on_record=records.put)
        cmd = [sys.executable, __file__, "--receiver", "--redis", server.url]
        cmd += ["--nbytes", str(nbytes), "--rounds", str(raw_rounds)]
        procs = [
            subprocess.Popen([*cmd, "--worker", f"r{i}", "--rank", str(i + 1)])
            for i in range(RECEIVERS)
        ]
        try:
            while sum(text(f).startswith("join:") for f in client.hkeys(KEYS.weights)) < RECEIVERS:
                time.sleep(0.05)
            yield client, records, pub
        finally:
            for p in procs:
                p.terminate()
            for p in procs:
                p.wait(30)
            pub.close()


def lora_models(args: argparse.Namespace) -> dict[str, list[tuple[str, torch.Tensor]]]:
    """What a full fine-tune and a LoRA run of the same model publish per step."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    from asyncrl.lora import synced, wrap
    from asyncrl.model_config import LoraConfig

    config = Qwen2Config(
        vocab_size=32000,
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 4,
        num_hidden_layers=args.layers,
        num_attention_heads=12,
        num_key_value_heads=4,
        tie_word_embeddings=False,
    )
    model = AutoModelForCausalLM.from_config(config)
    full = [(n, p.detach()) for n, p in model.named_parameters()]
    adapted = wrap(model, LoraConfig(rank=args.lora_rank))
    return {"full": full, "lora": [(n, p.detach()) for n, p in synced(adapted)]}


def lora_publisher(args: argparse.Namespace) -> None:
    """Full-weight and adapter-only syncs of one model, through the same publisher."""
    models = lora_models(args)
    result: dict[str, float] = {}
    version = 0
    with running(args, nbytes=8, raw_rounds=0) as (client, records, pub):
        for kind, params in models.items():
            rows = []
            for r in range(args.rounds + 1):
                blocking_s = pub.publish(params, version)
                record = records.get(timeout=300)
                assert record.ok and record.receivers == RECEIVERS, record
                wait_held(client, version)
                version += 1
                if r:  # the first of each kind forms buffers (and the group): a warm-up
                    rows.append((record.sync_s, blocking_s, record.bytes_sent))
                print(
                    f"{kind} round {r}: sync {record.sync_s:.3f}s  blocking "
                    f"{blocking_s * 1000:.1f}ms  {record.bytes_sent} B"
                )
            result[f"{kind}_params"] = sum(t.numel() for _, t in params)
            result[f"{kind}_bytes"] = statistics.median(x[2] for x in rows)
            result[f"{kind}_sync_s"] = round(statistics.median(x[0] for x in rows), 4)
            result[f"{kind}_blocking_s"] = round(statistics.median(x[1] for x in rows), 5)
    result["bytes_ratio"] = round(result["lora_bytes"] / result["full_bytes"], 5)
    print(json.dumps(result))


def publisher(args: argparse.Namespace) -> None:
    torch.manual_seed(0)
    params = make_model(args.mb)
    nbytes = sum(t.numel() * t.element_size() for t in params.values())
    rounds = args.rounds + 1
    with running(args, nbytes, rounds) as (client, records, pub):
        group = raw_group(client, 0)
        flat = torch.zeros(nbytes, dtype=torch.uint8)
        rows = []
        for version in range(rounds):
            blocking_s = pub.publish(params.items(), version)
            record = records.get(timeout=120)
            assert record.ok and record.receivers == RECEIVERS, record
            wait_held(client, version)
            raw_s = raw_broadcast(group, flat)
            rows.append((record.sync_s, raw_s, blocking_s))
            print(
                f"round {version}: asyncrl {record.sync_s:.3f}s  raw {raw_s:.3f}s  "
                f"blocking {blocking_s * 1000:.1f}ms" + ("  (warm-up)" if version == 0 else "")
            )
    send_s = statistics.median(r[0] for r in rows[1:])
    raw_s = statistics.median(r[1] for r in rows[1:])
    blocking_s = statistics.median(r[2] for r in rows[1:])
    mb = nbytes / 2**20
    result = {
        "mb": round(mb, 1),
        "asyncrl_mb_s": round(mb / send_s, 1),
        "raw_mb_s": round(mb / raw_s, 1),
        "ratio": round(raw_s / send_s, 3),
        "send_s": round(send_s, 4),
        "blocking_s": round(blocking_s, 4),
    }
    print(json.dumps(result))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=int, default=100, help="model size in MiB")
    parser.add_argument("--rounds", type=int, default=12, help="timed rounds after a warm-up")
    parser.add_argument("--bucket-mb", type=int, default=64)
    parser.add_argument("--lora", action="store_true", help="full weights vs a LoRA adapter")
    parser.add_argument("--hidden", type=int, default=768, help="--lora: the model's width")
    parser.add_argument("--layers", type=int, default=4, help="--lora: decoder layers")
    parser.add_argument("--lora-rank", type=int, default=8, help="--lora: the adapter's rank")
    parser.add_argument("--receiver", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--redis", help=argparse.SUPPRESS)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--nbytes", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.receiver:
        receiver(args)
    elif args.lora:
        lora_publisher(args)
    else:
        publisher(args)


if __name__ == "__main__":
    main()
