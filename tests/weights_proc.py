"""A rollout-worker stand-in for the weight-sync tests, and the helpers those tests share.

    python tests/weights_proc.py --redis URL --run RUN --worker ID [--type store] [--slow-s S]
        [--device cuda:1] [--keeps-dtype bfloat16]

The process subscribes and reports every version handed over to the Redis list
`report_key(run, worker)` as JSON {version, checksum, digest}: the checksum of all tensors and a
sha256 of a sample of them, which the test process compares with what it published. The version
its first `wait_for_version(0)` returned goes to `first_key(run, worker)`. SIGTERM closes the
subscriber (a clean leave) and exits 0.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import redis
import torch
from pydantic import TypeAdapter

from asyncrl.config import WeightsConfig
from asyncrl.launch.redis_server import RedisServer
from asyncrl.rollout.backends import build_subscriber
from asyncrl.runstate import Keys
from asyncrl.weights.broadcast import BroadcastSubscriber
from asyncrl.weights.buckets import Layout, checksum_tensors
from asyncrl.weights.delta import Delta, Held

HELPER = Path(__file__)


def report_key(run: str, worker: str) -> str:
    return f"test:{run}:got:{worker}"


def first_key(run: str, worker: str) -> str:
    return f"test:{run}:first:{worker}"


def digest(tensors: Mapping[str, torch.Tensor]) -> str:
    """sha256 over every fourth tensor (by name) and its bytes: a bit-exact sample."""
    h = hashlib.sha256()
    for name in sorted(tensors)[::4]:
        h.update(name.encode())
        h.update(tensors[name].contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def fingerprint(tensors: Mapping[str, torch.Tensor]) -> tuple[int, str]:
    return checksum_tensors(tensors.values()), digest(tensors)


def make_params(mb: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """A model of about `mb` MiB: fp32 and bf16 matrices, odd-sized bf16 biases (padding), an
    int64 counter, a bool mask and a 0-dim scalar."""
    g = torch.Generator().manual_seed(seed)
    params: dict[str, torch.Tensor] = {}
    for i in range(max(1, mb // 4)):
        weight = torch.randn(1024, 1024, generator=g)  # 4 MiB
        params[f"layers.{i:03d}.weight"] = weight if i % 2 else weight.repeat(1, 2).bfloat16()
        params[f"layers.{i:03d}.bias"] = torch.randn(1023, generator=g).bfloat16()
    params["step"] = torch.tensor([seed], dtype=torch.int64)
    params["scale"] = torch.tensor(0.5)
    params["mask"] = torch.rand(77, generator=g) > 0.5
    return params


def train_step(params: Mapping[str, torch.Tensor]) -> None:
    """Change every tensor in place, as an optimizer step would."""
    for t in params.values():
        if t.dtype == torch.bool:
            t.logical_not_()
        elif t.is_floating_point():
            t.add_(0.01)
        else:
            t.add_(1)


def got(client: redis.Redis, run: str, worker: str) -> list[dict[str, Any]]:
    return [json.loads(x) for x in client.lrange(report_key(run, worker), 0, -1)]


def versions(client: redis.Redis, run: str, worker: str) -> list[int]:
    return [r["version"] for r in got(client, run, worker)]


def restart_empty(server: RedisServer, data_dir: Path) -> None:
    """SIGKILL `server` and start it again on its port with no data, as a Redis without
    persistence (or one whose disk was lost) comes back."""
    server.kill()
    server.data_dir = data_dir
    server.start()


def spawn(
    log_dir: Path, redis_url: str, run: str, worker: str, *args: str
) -> subprocess.Popen[bytes]:
    log = (log_dir / f"{worker}.log").open("wb")
    cmd = [sys.executable, str(HELPER), "--redis", redis_url, "--run", run, "--worker", worker]
    return subprocess.Popen([*cmd, *args], stdout=log, stderr=subprocess.STDOUT)


def stop(procs: list[subprocess.Popen[bytes]]) -> None:
    """SIGTERM (clean leave) each process this test started, then SIGKILL stragglers."""
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(15)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def look_late(keys: Keys, worker: str) -> None:
    """Hold the subscriber's first look at the hash until an epoch has formed without it: it
    was proposed to it, and the publisher gave up waiting for its answer."""
    step = BroadcastSubscriber._step
    looked = threading.Event()

    def late_step(self: BroadcastSubscriber) -> None:
        while not looked.is_set():
            h = self._client.hgetall(keys.weights)
            if b"epoch" in h and worker.encode() not in h.get(b"members", b"[]"):
                looked.set()
            time.sleep(0.05)
        step(self)

    BroadcastSubscriber._step = late_step  # type: ignore[method-assign]


def refuse_once() -> None:
    """Make the first delta that applies fail its checksum, as a corrupted copy would."""
    apply = Held.apply
    refused = threading.Event()

    def corrupted(self: Held, delta: Delta, layout: Layout) -> torch.Tensor:
        if not refused.is_set() and self.flat is not None and self.version == delta.base:
            refused.set()
            self.flat[0] ^= 1
        return apply(self, delta, layout)

    Held.apply = corrupted  # type: ignore[method-assign]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--redis", required=True)
    parser.add_argument("--run", required=True)
    parser.add_argument("--worker", required=True)
    parser.add_argument("--type", default="broadcast")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--store-dir", type=Path)
    parser.add_argument("--sync-timeout-s", type=float, default=5.0)
    parser.add_argument("--lease-s", type=float, default=1.5)
    parser.add_argument("--slow-s", type=float, default=0.0, help="sleep in on_weights")
    parser.add_argument("--keeps-dtype", help="the floating dtype the 'engine' keeps (bfloat16)")
    parser.add_argument(
        "--die-joining", action="store_true", help="SIGKILL itself once it is a member, unjoined"
    )
    parser.add_argument(
        "--refuse-delta",
        action="store_true",
        help="refuse the first delta it could apply, as if its copy were corrupted",
    )
    parser.add_argument(
        "--look-late",
        action="store_true",
        help="registered, first look only once an epoch has formed without it (slow to start)",
    )
    args = parser.parse_args()
    if args.look_late:
        look_late(Keys(args.run), args.worker)
    if args.refuse_delta:
        refuse_once()
    if args.die_joining:
        BroadcastSubscriber._join = lambda *_: os.kill(os.getpid(), signal.SIGKILL)  # type: ignore[method-assign]
    logging.basicConfig(level=logging.INFO, format=f"{args.worker} %(levelname)s %(message)s")
    torch.set_num_threads(1)

    client = redis.Redis.from_url(args.redis)
    fields = {"type": args.type, "sync_timeout_s": args.sync_timeout_s, "lease_s": args.lease_s}
    if args.type == "store":
        fields["store_dir"] = args.store_dir
    cfg: WeightsConfig = TypeAdapter(WeightsConfig).validate_python(fields)

    def on_weights(tensors: dict[str, torch.Tensor], version: int) -> None:
        check, sample = fingerprint({k: t.cpu() for k, t in tensors.items()})
        report = {"version": version, "checksum": check, "digest": sample}
        client.rpush(report_key(args.run, args.worker), json.dumps(report))
        time.sleep(args.slow_s)

    stopping = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stopping.set())
    keeps = getattr(torch, args.keeps_dtype) if args.keeps_dtype else None
    sub = build_subscriber(
        cfg,
        client,
        Keys(args.run),
        args.worker,
        device=args.device,
        on_weights=on_weights,
        keeps_dtype=keeps,
    )
    while not stopping.is_set():
        try:
            first = sub.wait_for_version(0, timeout_s=0.5)
        except TimeoutError:
            continue
        client.set(first_key(args.run, args.worker), first)
        break
    stopping.wait()
    sub.close()


if __name__ == "__main__":
    main()
