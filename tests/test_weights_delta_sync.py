"""Delta sync among real processes (gloo on CPU, bf16 engines): a worker killed and restarted
mid-run, one joining late, the trainer's publisher restarted — every worker's weights equal,
bit for bit, what the trainer published for the version it reports, at every sync."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import cast

import torch

from asyncrl.weights.base import SyncRecord, WeightPublisher
from asyncrl.weights.broadcast import BroadcastPublisher
from asyncrl.weights.buckets import FlatBuffer, Layout
from asyncrl.weights.fields import BroadcastDeltaFields

from role_procs import wait_until
from weights_harness import CFG, RUN, Harness
from weights_proc import fingerprint, got, make_params

BF16 = ("--keeps-dtype", "bfloat16")


def engine_view(params: dict[str, torch.Tensor]) -> tuple[int, str]:
    """What a bf16 engine holds of `params` after a full sync."""
    buf = FlatBuffer(Layout.of(params.items(), torch.bfloat16), torch.device("cpu"))
    buf.pack(params.items())
    return fingerprint(buf.tensors)


def narrowing(pub: WeightPublisher) -> None:
    """Wait until the publisher has seen that its subscribers keep bf16 (it stages in it)."""
    staging = cast(BroadcastPublisher, pub)
    wait_until(lambda: staging._narrow_to == torch.bfloat16, 30, "bf16 engines seen")


def sparse_step(params: dict[str, torch.Tensor], version: int) -> None:
    """A step that moves a few rows (most of an RL step rounds away in bf16)."""
    params["layers.001.weight"][version * 7 : version * 7 + 5] += 0.5
    params["step"] += 1


def test_kill_restart_join_and_trainer_restart_keep_every_worker_exact(
    harness: Harness, tmp_path: Path
) -> None:
    delta = BroadcastDeltaFields(enabled=True, anchor_every=6, pull_dir=tmp_path / "pull")
    cfg = CFG.model_copy(update={"delta": delta})
    harness.spawn("a", "b", args=BF16)
    pub = harness.publish_to({"a", "b"}, cfg)
    narrowing(pub)
    params = make_params(8)
    expected: dict[int, tuple[int, str]] = {}
    sent: dict[int, list[SyncRecord]] = {}
    full = Layout.of(params.items(), torch.bfloat16).total_bytes

    def deliveries(version: int, done: Callable[[list[SyncRecord]], bool] = bool) -> list[int]:
        """The bytes of each delivery of `version` so far, once `done` holds for them. A worker
        reports a version as soon as it has it; the publisher records the delivery after the
        send returns, so a `hold` does not mean the record is there yet."""

        def drained() -> bool:
            while not harness.records.empty():
                record = harness.records.get()
                if record.ok and record.receivers:
                    sent.setdefault(record.version, []).append(record)
            return done(sent.get(version, []))

        wait_until(drained, 30, f"deliveries of v{version}")
        return [r.bytes_sent for r in sent[version]]

    def publish(version: int, workers: list[str]) -> None:
        assert harness.publisher is not None
        harness.publisher.publish(params.items(), version)
        expected[version] = engine_view(params)
        harness.hold(workers, version, expected[version])

    def is_delta(nbytes: int) -> bool:
        return nbytes < 0.05 * full

    publish(0, ["a", "b"])
    sparse_step(params, 1)
    publish(1, ["a", "b"])
    assert deliveries(0)[0] == full and is_delta(deliveries(1)[0])  # an anchor, then a delta

    harness.kill("b")  # mid-run: the next send finds it gone
    sparse_step(params, 2)
    publish(2, ["a"])
    harness.spawn("b", args=BF16)  # restarted under its id: it pulls what it lacks
    assert harness.first_version("b") == 2
    harness.hold(["b"], 2, expected[2])

    sparse_step(params, 3)
    publish(3, ["a", "b"])
    harness.spawn("c", args=BF16)  # joins late
    assert harness.first_version("c") == 3
    harness.hold(["c"], 3, expected[3])
    # The group went on with deltas, the resend to the group rebuilt for c among them.
    with_c = deliveries(3, lambda records: any(r.receivers == 3 for r in records))
    assert all(map(is_delta, with_c))

    # The trainer restarts (from a checkpoint): its publisher knows no base. This one has no
    # directory to pull from, so whoever lacks the base gets an anchor, sent to the group.
    pub.close()
    harness.publisher = None
    pub = harness.publish_to(
        {"a", "b", "c"},
        CFG.model_copy(update={"delta": delta.model_copy(update={"pull_dir": None})}),
    )
    narrowing(pub)
    sparse_step(params, 4)
    publish(4, ["a", "b", "c"])
    sparse_step(params, 5)
    publish(5, ["a", "b", "c"])
    assert deliveries(4)[0] == full and is_delta(deliveries(5)[0])
    harness.spawn("d", args=(*BF16, "--refuse-delta"))  # its copy goes bad at the next delta
    harness.hold(["d"], 5, expected[5])
    sparse_step(params, 6)
    publish(6, ["a", "b", "c", "d"])  # d refused the delta and asked for an anchor: it got one
    to_d = deliveries(6, lambda records: any(r.bytes_sent == full for r in records))
    assert is_delta(to_d[0]) and "asking for an anchor" in (tmp_path / "d.log").read_text()
    sparse_step(params, 7)
    publish(7, ["a", "b", "c", "d"])
    assert all(map(is_delta, deliveries(7)))

    for worker in ("b", "c"):  # neither made the group go back to full: they pulled
        assert "pulled from" in (tmp_path / f"{worker}.log").read_text()
    # Every version each worker reported is bit for bit what was published as it.
    for worker in ("a", "b", "c", "d"):
        reports = got(harness.client, RUN, worker)
        assert reports
        for r in reports:
            assert (r["checksum"], r["digest"]) == expected[r["version"]], (worker, r)
