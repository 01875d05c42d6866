"""The store transport: atomic files, retention, announcements, and a subscriber (a real
`weights_proc.py` process) that loads the newest valid version, never a partial or corrupt one."""

from __future__ import annotations

import queue
from pathlib import Path

import redis
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from asyncrl.launch.redis_server import RedisServer
from asyncrl.rollout.backends import build_subscriber
from asyncrl.runstate import Keys
from asyncrl.trainer.backends import build_publisher
from asyncrl.weights.base import SyncRecord, WeightSubscriber
from asyncrl.weights.buckets import checksum_tensors
from asyncrl.weights.config import StoreWeightsConfig
from asyncrl.weights.fields import DeltaFields
from asyncrl.weights.versions import version_path

from role_procs import wait_until
from weights_proc import (
    fingerprint,
    got,
    make_params,
    restart_empty,
    spawn,
    stop,
    train_step,
)

RUN = "wstore"
KEYS = Keys(RUN)


def cfg(store_dir: Path) -> StoreWeightsConfig:
    return StoreWeightsConfig(type="store", store_dir=store_dir, keep_last=3, sync_timeout_s=5.0)


def test_files_are_written_atomically_and_only_the_last_k_kept(
    redis_client: redis.Redis, tmp_path: Path
) -> None:
    store_dir = tmp_path / "weights"
    store_dir.mkdir()
    partial = store_dir / f".{version_path(store_dir, 9).name}.tmp"
    partial.write_bytes(b"half a file")  # what a crashed writer leaves
    records: queue.Queue[SyncRecord] = queue.Queue()
    pub = build_publisher(cfg(store_dir), redis_client, KEYS, device="cpu", on_record=records.put)
    assert not partial.exists()
    params = make_params(8)
    try:
        for version in range(5):
            pub.publish(params.items(), version)
            record = records.get(timeout=30)
            assert (
                record.ok and record.bytes_sent == version_path(store_dir, version).stat().st_size
            )
            if version < 4:
                train_step(params)
    finally:
        pub.close()
    assert sorted(p.name for p in store_dir.iterdir()) == [
        version_path(store_dir, v).name for v in (2, 3, 4)
    ]
    meta = redis_client.hgetall(KEYS.weights)
    assert meta[b"transport"] == b"store" and meta[b"store_version"] == b"4"
    assert meta[b"store_path"] == str(version_path(store_dir, 4)).encode()
    with safe_open(version_path(store_dir, 4), framework="pt") as f:
        loaded = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
        assert f.metadata() == {"version": "4", "checksum": str(checksum_tensors(params.values()))}
    assert loaded.keys() == params.keys()
    assert fingerprint(loaded) == fingerprint(params)


def test_subscriber_loads_the_newest_valid_version_only(
    redis_server: RedisServer, redis_client: redis.Redis, tmp_path: Path
) -> None:
    store_dir = tmp_path / "weights"
    proc = spawn(
        tmp_path, redis_server.url, RUN, "a", "--type", "store", "--store-dir", str(store_dir)
    )
    pub = build_publisher(cfg(store_dir), redis_client, KEYS, device="cpu")
    late = None
    try:
        params = make_params(8)
        pub.publish(params.items(), 0)
        expected = fingerprint(params)
        wait_until(
            lambda: [r["version"] for r in got(redis_client, RUN, "a")] == [0], 60, "a at v0"
        )
        assert (
            got(redis_client, RUN, "a")[0]["checksum"],
            got(redis_client, RUN, "a")[0]["digest"],
        ) == expected

        # Two bad files announced as if a broken writer had made them: a truncated one, and one
        # whose data no longer matches its checksum. Neither may be handed over.
        good = version_path(store_dir, 0).read_bytes()
        version_path(store_dir, 10).write_bytes(good[:-100])
        announce_file(redis_client, store_dir, 10)
        wait_until(lambda: rejected(tmp_path, 10), 60, "v10 rejected")
        tampered = {k: v.clone() for k, v in params.items()}
        meta = {"version": "11", "checksum": str(checksum_tensors(tampered.values()))}
        tampered["step"] += 1
        save_file(tampered, version_path(store_dir, 11), metadata=meta)
        announce_file(redis_client, store_dir, 11)
        wait_until(lambda: rejected(tmp_path, 11), 60, "v11 rejected")

        train_step(params)
        pub.publish(params.items(), 12)
        expected = fingerprint(params)
        wait_until(lambda: got(redis_client, RUN, "a")[-1]["version"] == 12, 60, "a at v12")
        report = got(redis_client, RUN, "a")[-1]
        assert (report["checksum"], report["digest"]) == expected
        assert [r["version"] for r in got(redis_client, RUN, "a")] == [0, 12]

        # A worker that starts now bootstraps from the newest file.
        late, held = join_late(store_dir, redis_client)
        assert late.wait_for_version(0, timeout_s=30) == 12
        assert fingerprint(held) == expected
    finally:
        if late is not None:
            late.close()
        stop([proc])
        pub.close()


def join_late(
    store_dir: Path, client: redis.Redis, conf: StoreWeightsConfig | None = None
) -> tuple[WeightSubscriber, dict[str, torch.Tensor]]:
    """A worker "late" that joins now, and the tensors it is handed."""
    held: dict[str, torch.Tensor] = {}
    late = build_subscriber(
        conf or cfg(store_dir),
        client,
        KEYS,
        "late",
        device="cpu",
        on_weights=lambda t, _: held.update(t),
    )
    return late, held


def announce_file(client: redis.Redis, store_dir: Path, version: int) -> None:
    client.hset(
        KEYS.weights,
        mapping={"store_version": version, "store_path": str(version_path(store_dir, version))},
    )
    client.publish(KEYS.weights, "store_version")


def rejected(log_dir: Path, version: int) -> bool:
    return f"weights version {version} at" in (log_dir / "a.log").read_text()


def test_a_worker_joining_after_redis_came_back_empty_loads_the_current_version(
    redis_server: RedisServer, redis_client: redis.Redis, tmp_path: Path
) -> None:
    # The announce lived in Redis only: without it again, a worker that joins after the loss
    # would wait for the next publish, which a trainer short of groups never makes.
    store_dir = tmp_path / "weights"
    records: queue.Queue[SyncRecord] = queue.Queue()
    pub = build_publisher(cfg(store_dir), redis_client, KEYS, device="cpu", on_record=records.put)
    late = None
    try:
        params = make_params(8)
        pub.publish(params.items(), 3)
        assert records.get(timeout=30).ok
        restart_empty(redis_server, tmp_path / "redis-empty")
        late, held = join_late(store_dir, redis_client)
        assert late.wait_for_version(0, timeout_s=30) == 3
        assert fingerprint(held) == fingerprint(params)
        assert redis_client.hget(KEYS.weights, "transport") == b"store"
        assert pub.stats().published == 1
    finally:
        if late is not None:
            late.close()
        pub.close()


def test_delta_files_chain_from_anchors_and_a_late_worker_pulls_them(
    redis_client: redis.Redis, tmp_path: Path
) -> None:
    store_dir = tmp_path / "weights"
    delta = DeltaFields(enabled=True, anchor_every=3)
    conf = cfg(store_dir).model_copy(update={"delta": delta, "keep_last": 1})
    records: queue.Queue[SyncRecord] = queue.Queue()
    pub = build_publisher(conf, redis_client, KEYS, device="cpu", on_record=records.put)
    handed: list[tuple[int, tuple[int, str]]] = []
    early = build_subscriber(
        conf,
        redis_client,
        KEYS,
        "early",
        device="cpu",
        on_weights=lambda t, v: handed.append((v, fingerprint(t))),
    )
    late = None
    try:
        params = make_params(8)
        expected, sizes, deltas = {}, {}, []
        for version in range(5):
            pub.publish(params.items(), version)
            expected[version] = fingerprint(params)
            record = records.get(timeout=30)
            sizes[version] = record.bytes_sent
            deltas.append(record.delta)
            early.wait_for_version(version, timeout_s=30)
            params["layers.001.weight"][version] += 1.0  # one row of 1024 changes
        # Anchors at 0 and 3 (every third version), deltas between; only the newest anchor and
        # the deltas that can follow it are kept.
        assert sorted(p.name for p in store_dir.glob("*.safetensors")) == [
            version_path(store_dir, 3).name
        ]
        assert sorted(p.name for p in (store_dir / "delta").iterdir()) == [
            version_path(store_dir, v).name for v in (1, 2, 4)
        ]
        assert all(sizes[v] < sizes[0] / 100 for v in (1, 2, 4))
        assert deltas == [False, True, True, False, True]
        assert handed == [(v, expected[v]) for v in range(5)]
        # A worker that starts now takes anchor 3 and delta 4.
        late, held = join_late(store_dir, redis_client, conf)
        assert late.wait_for_version(0, timeout_s=30) == 4
        assert fingerprint(held) == expected[4]
    finally:
        for sub in (early, late):
            if sub is not None:
                sub.close()
        pub.close()
