"""The broadcast weight-sync tests' harness: a publisher here, `weights_proc.py` subscribers
as real processes, and what they report (the `harness` fixture is in conftest.py)."""

from __future__ import annotations

import functools
import queue
import subprocess
from pathlib import Path

import redis
import torch

from asyncrl.launch.redis_server import RedisServer
from asyncrl.runstate import Keys
from asyncrl.trainer.backends import build_publisher
from asyncrl.weights.base import SyncRecord, WeightPublisher, text
from asyncrl.weights.buckets import Layout
from asyncrl.weights.config import BroadcastWeightsConfig

from role_procs import wait_until
from weights_proc import fingerprint, first_key, got, make_params, report_key, spawn, stop, versions

RUN = "wtest"
KEYS = Keys(RUN)
CFG = BroadcastWeightsConfig(sync_timeout_s=5.0, lease_s=1.5, bucket_mb=16)


class Harness:
    def __init__(self, server: RedisServer, client: redis.Redis, log_dir: Path) -> None:
        self.server, self.client, self.log_dir = server, client, log_dir
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.records: queue.Queue[SyncRecord] = queue.Queue()
        self.publisher: WeightPublisher | None = None

    def spawn(self, *workers: str, args: tuple[str, ...] = ()) -> None:
        for w in workers:
            self.procs[w] = spawn(self.log_dir, self.server.url, RUN, w, *args)

    def kill(self, worker: str) -> None:
        """SIGKILL `worker` and forget what it reported: a replacement under its id must be
        judged on its own reports, not on its predecessor's (its first version, above all)."""
        victim = self.procs.pop(worker)
        victim.kill()
        victim.wait()
        self.client.delete(report_key(RUN, worker), first_key(RUN, worker))

    def publish_to(self, workers: set[str], cfg: BroadcastWeightsConfig = CFG) -> WeightPublisher:
        self.publisher = build_publisher(
            cfg, self.client, KEYS, device="cpu", on_record=self.records.put
        )
        wait_until(lambda: self.registered() == workers, 60, f"{workers} registered")
        return self.publisher

    def one_worker_at_v0(self, *args: str) -> tuple[WeightPublisher, dict[str, torch.Tensor]]:
        """Worker "a" (started with `args`), a publisher to it, and version 0 (parameters of
        about 1 MiB) published and held."""
        self.spawn("a", args=args)
        pub = self.publish_to({"a"})
        params = make_params(1)
        pub.publish(params.items(), 0)
        self.hold(["a"], 0, fingerprint(params))
        return pub, params

    def registered(self) -> set[str]:
        fields = [text(f) for f in self.client.hkeys(KEYS.weights)]
        return {f.removeprefix("join:") for f in fields if f.startswith("join:")}

    @staticmethod
    def full_bytes(params: dict[str, torch.Tensor]) -> int:
        return Layout.of(params.items()).total_bytes

    def holds(self, worker: str, version: int) -> bool:
        return version in versions(self.client, RUN, worker)

    def hold(self, workers: list[str], version: int, expected: tuple[int, str]) -> None:
        """Wait until each worker reports `version`, then compare it bit for bit."""
        for w in workers:
            wait_until(functools.partial(self.holds, w, version), 60, f"{w} at v{version}")
            report = next(r for r in got(self.client, RUN, w) if r["version"] == version)
            assert (report["checksum"], report["digest"]) == expected, (w, version)

    def first_version(self, worker: str) -> int:
        """What `worker`'s first wait for weights returned. Its main thread records it after the
        weights callback has reported, so a `hold` does not mean it is there yet."""
        key = first_key(RUN, worker)
        wait_until(lambda: self.client.get(key) is not None, 60, f"{worker}'s first weights")
        return int(self.client.get(key))  # type: ignore[arg-type]

    def close(self) -> None:
        stop(list(self.procs.values()))
        if self.publisher is not None:
            self.publisher.close()
