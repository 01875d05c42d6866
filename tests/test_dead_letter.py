"""Every validation rule of DESIGN §4, through the trainer's own read path.

A real `Trainer` (random tiny model, real Redis) collects a step from a trajectories stream where
one bad entry sits between two good ones, all of released groups: the bad entry ends in `dlq`
with its reason and is acked, `groups_dead_lettered` grows by exactly one where the entry still
names its group (the group ends: its prompt is not waited for), `entries_rejected` where it names
none, and both good groups are delivered. A group staler than η is dropped and counted instead
(DESIGN §5).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
import redis

from asyncrl.config import load_config
from asyncrl.launch.redis_server import RedisServer
from asyncrl.protocol import encode_group, stream_fields
from asyncrl.runstate import TRAJECTORIES_GROUP, Counter, read_counters
from asyncrl.trainer.length_bias import LengthBias
from asyncrl.trainer.main import Trainer

from sample_groups import VERSION, make_group

ETA = 2
MAX_MESSAGE_BYTES = 16384
LONG = np.array([4, 5, 6, 7, 8, 2], np.int32)
"""A response twice as long as `make_group`'s."""
LOGP = np.full(6, -0.5, np.float32)


def entry(**change: Any) -> dict[bytes | str, bytes]:
    """Stream fields of a group, written the way a rollout worker writes them."""
    return stream_fields(make_group("bad", **change))


def with_routing(routed: np.ndarray) -> dict[bytes | str, bytes]:
    """A valid group whose second sample carries `routed` as its routed experts."""
    group = make_group("bad")
    group.samples[1].routed_experts = routed
    return stream_fields(group)


def raw(data: bytes) -> dict[bytes | str, bytes]:
    return {"data": data, "schema": b"1", "min_version": b"0"}


def patched(schema: int = 1, **keys: Any) -> dict[bytes | str, bytes]:
    """A valid group's message with top-level keys replaced as another encoder might write them
    (in schema 1's layout, one map per sample, by default)."""
    message = msgpack.unpackb(encode_group(make_group("bad", schema=schema)))
    return raw(msgpack.packb({**message, **keys}))


F32, I32 = np.float32, np.int32

# (rule, stream fields of the bad entry, reason expected in dlq)
BAD: list[tuple[str, Callable[[], dict[bytes | str, bytes]], str]] = [
    ("unknown schema", lambda: entry(schema=3), "schema"),
    ("schema field missing", lambda: raw(msgpack.packb({"run": "dlq"})), "schema"),
    (
        "length mismatch",
        lambda: entry(logprobs=np.array([-0.5, -1.0], F32)),
        "length_mismatch",
    ),
    (
        "versions length mismatch",
        lambda: entry(versions=np.array([VERSION], I32)),
        "length_mismatch",
    ),
    (
        "non-finite logprob",
        lambda: entry(logprobs=np.array([-0.5, np.nan, -0.1], F32)),
        "logprob_not_finite",
    ),
    (
        "infinite logprob",
        lambda: entry(logprobs=np.array([-np.inf, -1.0, -0.1], F32)),
        "logprob_not_finite",
    ),
    (
        "positive logprob",
        lambda: entry(logprobs=np.array([-0.5, 0.25, -0.1], F32)),
        "logprob_positive",
    ),
    (
        "decreasing versions",
        lambda: entry(versions=np.array([VERSION, VERSION - 1, VERSION], I32)),
        "versions_decreasing",
    ),
    (
        "version ahead of the trainer",
        lambda: entry(versions=np.array([VERSION, VERSION, VERSION + 1], I32)),
        "version_ahead",
    ),
    (
        "response id past the vocabulary",  # the random tiny model's 15 tokens
        lambda: entry(response_ids=np.array([4, 15, 2], I32)),
        "token_out_of_range",
    ),
    (
        "negative prompt id",
        lambda: entry(prompt_ids=np.array([1, -5, 6], I32)),
        "token_out_of_range",
    ),
    (
        "routed experts not one row per fed token",  # 7 prompt + 3 response tokens: 9 rows
        lambda: with_routing(np.zeros((3, 2, 2), np.uint16)),
        "routing_shape",
    ),
    ("non-finite reward", lambda: entry(reward=float("nan")), "reward_not_finite"),
    ("infinite reward", lambda: entry(reward=float("inf")), "reward_not_finite"),
    (
        "oversize message",
        lambda: entry(prompt_ids=np.ones(MAX_MESSAGE_BYTES // 4 + 1, I32)),
        "too_large",
    ),
    ("malformed bytes", lambda: raw(b"\xc1\x00garbage"), "malformed"),
    ("truncated message", lambda: raw(encode_group(make_group("t"))[:-7]), "malformed"),
    ("not a map", lambda: raw(msgpack.packb([1, 2, 3])), "malformed"),
    ("no data field", lambda: {"schema": b"1"}, "malformed"),
    ("wrong field type", lambda: patched(release_version="7"), "malformed"),
    ("samples not a list", lambda: patched(samples={"0": 1}), "malformed"),
    ("empty prompt", lambda: entry(prompt_ids=np.array([], I32)), "malformed"),
    ("no samples", lambda: patched(samples=[]), "malformed"),
    ("bulk lengths not bytes", lambda: patched(2, lengths=[3, 3]), "malformed"),
    ("bulk no samples", lambda: patched(2, lengths=b""), "malformed"),
]
# Bad entries in which no group id can be found.
NAMELESS = {"schema field missing", "malformed bytes", "not a map", "no data field"}


@pytest.fixture(scope="module")
def trainer(
    module_redis: RedisServer, random_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Trainer]:
    run_dir = tmp_path_factory.mktemp("run")
    cfg = load_config(
        None,
        [
            "run.id=dlq",
            f"run.dir={run_dir}",
            f"redis.url={module_redis.url}",
            f"model.path={random_model}",
            "metrics.port=0",
            "weights.type=store",
            "trainer.groups_per_step=2",
            "trainer.wait_timeout_s=30",
            "trainer.device=cpu",
            f"algo.max_staleness={ETA}",
            f"queue.max_message_bytes={MAX_MESSAGE_BYTES}",
            "rollout.n=2",
        ],
    )
    t = Trainer(cfg)
    t.version = VERSION
    try:
        yield t
    finally:
        t.close()


@pytest.fixture
def client(module_redis: RedisServer) -> Iterator[redis.Redis]:
    with redis.Redis.from_url(module_redis.url) as c:
        yield c


def collect(
    trainer: Trainer,
    client: redis.Redis,
    fields: list[dict[bytes | str, bytes]],
    released: list[str],
) -> Any:
    """Release the groups `released` (as admission would), add `fields` to the trajectories
    stream; the step's groups the trainer collects, the ids added, the counters' and dlq's
    growth."""
    keys = trainer.keys
    client.hset(keys.released, mapping=dict.fromkeys(released, ""))
    before = read_counters(client, keys)
    dlq_before = client.xrange(keys.dlq)
    ids = [client.xadd(keys.trajectories, f).decode() for f in fields]  # type: ignore[union-attr]
    groups, staleness, got_ids = trainer._collect()
    trainer.prefetch.flush()  # stale drops are acked on the reading thread
    after = read_counters(client, keys)
    grown = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    new_dlq = client.xrange(keys.dlq)[len(dlq_before) :]
    # The step "runs" and checkpoints: ack the collected groups like the trainer does.
    assert trainer.prefetch.settle(got_ids, Counter.GROUPS_TRAINED) == len(got_ids)
    return groups, staleness, got_ids, ids, grown, new_dlq


def pending_ids(client: redis.Redis, stream: str) -> set[str]:
    rows = client.xpending_range(stream, TRAJECTORIES_GROUP, "-", "+", 1000)
    return {r["message_id"].decode() for r in rows}


@pytest.mark.parametrize(("rule", "make_bad", "reason"), BAD, ids=[b[0] for b in BAD])
def test_bad_entry_is_dead_lettered(
    trainer: Trainer,
    client: redis.Redis,
    rule: str,
    make_bad: Callable[[], dict[bytes | str, bytes]],
    reason: str,
) -> None:
    good = [f"good-{rule}-{i}" for i in (0, 1)]
    groups, _, got_ids, ids, grown, new_dlq = collect(
        trainer,
        client,
        [stream_fields(make_group(good[0])), make_bad(), stream_fields(make_group(good[1]))],
        [*good, "bad", "t"],
    )
    assert [g.group_id for g in groups] == good
    assert got_ids == [ids[0], ids[2]]
    named = rule not in NAMELESS
    assert grown.get(Counter.GROUPS_DEAD_LETTERED, 0) == int(named)
    assert grown.get(Counter.ENTRIES_REJECTED, 0) == int(not named)
    assert grown.get(Counter.GROUPS_DROPPED_STALE, 0) == 0
    # The good groups ended trained, a bad entry that names its group ended that one (the
    # truncated message names "t"), a nameless one ended none.
    ended = ("t" if rule == "truncated message" else "bad") if named else None
    ours = [*good, "bad", "t"]  # the trainer's admission releases prompts of its own
    found = client.hmget(trainer.keys.released, ours)
    assert {g for g, v in zip(ours, found, strict=True) if v is not None} == {"bad", "t"} - {ended}
    assert len(new_dlq) == 1
    _, dead = new_dlq[0]
    assert dead[b"reason"].decode() == reason, dead[b"detail"]
    assert dead[b"id"].decode() == ids[1]
    assert dead[b"stream"].decode() == trainer.keys.trajectories
    assert ids[1] not in pending_ids(client, trainer.keys.trajectories)  # acked


def test_stale_group_is_dropped_and_counted(
    trainer: Trainer, client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(trainer.cfg.algo, "stale_policy", "drop")
    at_bound = np.array([VERSION - ETA] * 3, I32)
    beyond = np.array([VERSION - ETA - 1] + [VERSION] * 5, I32)
    groups, staleness, got_ids, ids, grown, new_dlq = collect(
        trainer,
        client,
        [
            stream_fields(make_group("stale", versions=beyond, response_ids=LONG, logprobs=LOGP)),
            stream_fields(make_group("at-bound", versions=at_bound)),
            stream_fields(make_group("fresh")),
        ],
        ["stale", "at-bound", "fresh"],
    )
    assert [g.group_id for g in groups] == ["at-bound", "fresh"]
    assert staleness == [ETA, 1]
    assert got_ids == ids[1:]
    assert grown[Counter.GROUPS_DROPPED_STALE] == 1
    assert grown.get(Counter.GROUPS_DEAD_LETTERED, 0) == 0
    assert new_dlq == []
    assert ids[0] not in pending_ids(client, trainer.keys.trajectories)  # acked, not trained
    # The stale group ended with its ack.
    assert client.hmget(trainer.keys.released, ["stale", "at-bound", "fresh"]) == [None] * 3
    # The length bias sees it: the dropped group was the long one (6 tokens, the others 3:
    # generated {6, 3, 3}, trained {3, 3}).
    dropped, trainer.dropped = trainer.dropped, []
    assert [g.group_id for g in dropped] == ["stale"]
    assert LengthBias().step(groups, dropped)["length_bias_ks"] == pytest.approx(1 / 3)


def test_under_the_default_policy_a_stale_group_is_trained(
    trainer: Trainer, client: redis.Redis
) -> None:
    """`algo.stale_policy: train`: the group staler than η is collected with its staleness,
    nothing dropped, and the length bias of the step is 0."""
    assert trainer.cfg.algo.stale_policy == "train"
    beyond = np.array([VERSION - ETA - 3] * 6, I32)
    groups, staleness, got_ids, ids, grown, new_dlq = collect(
        trainer,
        client,
        [
            stream_fields(make_group("old", versions=beyond, response_ids=LONG, logprobs=LOGP)),
            stream_fields(make_group("new")),
        ],
        ["old", "new"],
    )
    assert [g.group_id for g in groups] == ["old", "new"]
    assert staleness == [ETA + 3, 1]
    assert got_ids == ids
    assert grown.get(Counter.GROUPS_DROPPED_STALE, 0) == 0
    assert new_dlq == [] and trainer.dropped == []
    assert LengthBias().step(groups, trainer.dropped)["length_bias_ks"] == 0.0
