"""The run's shared state in Redis, and its one owner: key names (DESIGN §3; every key lives
under `asyncrl:{run_id}:`), the accounting counters and typed reads of what the roles share
(counters, live workers, the published version, stream depths). Admission, `asyncrl status`,
progress, the metrics poller and the chaos tool read the run through here. What it reads others
write (`asyncrl.heartbeat` the workers' beats, `asyncrl.queue` the streams); it imports neither.

redis is not imported: the key names are needed by the config-light parts (launchers, `--help`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, fields, replace
from enum import StrEnum
from typing import TYPE_CHECKING, Any, cast

import msgpack

if TYPE_CHECKING:
    import redis

log = logging.getLogger(__name__)

PROMPTS_GROUP = "rollout"
TRAJECTORIES_GROUP = "trainer"
ROLES = ("rollout", "trainer")
"""The roles that beat (`asyncrl.heartbeat`): the pools of `workers`."""
_MAX_BEAT_BYTES = 64 * 1024  # a status map is a few hundred bytes; anything bigger is not ours

# Entries after `ARGV[1]`, counted server-side (Redis 6.2 has no `lag` in XINFO GROUPS).
_COUNT_AFTER_LUA = """
local n, start = 0, '(' .. ARGV[1]
while true do
  local batch = redis.call('XRANGE', KEYS[1], start, '+', 'COUNT', 1000)
  if #batch == 0 then return n end
  n = n + #batch
  start = '(' .. batch[#batch][1]
end
"""


class Counter(StrEnum):
    """The fields of the run's `counters` hash. They count durable outcomes only, so at any quiet
    moment: prompts_released = groups_trained + groups_dropped_stale + groups_dead_lettered +
    groups_lost + HLEN(released) (`Counters.is_balanced`). `entries_rejected` counts
    dead-lettered entries that ended no released group (junk, duplicates) and stays out of that
    sum; `groups_lost` the groups in flight when Redis lost its data
    (`asyncrl.trainer.admission`)."""

    PROMPTS_RELEASED = "prompts_released"
    GROUPS_PUBLISHED = "groups_published"
    GROUPS_TRAINED = "groups_trained"
    GROUPS_DROPPED_STALE = "groups_dropped_stale"
    GROUPS_DEAD_LETTERED = "groups_dead_lettered"
    GROUPS_LOST = "groups_lost"
    ENTRIES_REJECTED = "entries_rejected"

    @property
    def outcome(self) -> str:
        """The name less its noun, e.g. `released`: the `outcome` label of `asyncrl_run_groups`."""
        return self.value.partition("_")[2]


ENDED = (
    Counter.GROUPS_TRAINED,
    Counter.GROUPS_DROPPED_STALE,
    Counter.GROUPS_DEAD_LETTERED,
    Counter.GROUPS_LOST,
)
"""The outcomes that end a released group."""
FREED = ENDED[1:]
"""The outcomes that end a group untrained: each frees its slot in the admission budget."""


@dataclass(frozen=True, slots=True, eq=False)
class Counters(Mapping[str, int]):
    """The `counters` hash as read: a field Redis lacks is 0. A mapping by `Counter` too, so
    `counters[outcome]` reads the counter an outcome names, and it compares equal to a dict."""

    prompts_released: int = 0
    groups_published: int = 0
    groups_trained: int = 0
    groups_dropped_stale: int = 0
    groups_dead_lettered: int = 0
    groups_lost: int = 0
    entries_rejected: int = 0

    @classmethod
    def from_hash(cls, raw: Mapping[Any, Any]) -> Counters:
        """From HGETALL's reply (bytes or str); fields that are not counters are left out."""
        values = {k.decode() if isinstance(k, bytes) else k: int(v) for k, v in raw.items()}
        return cls(**{c.value: values[c] for c in Counter if c in values})

    def __getitem__(self, name: str) -> int:
        try:
            counter = Counter(name)
        except ValueError:
            raise KeyError(name) from None
        return int(getattr(self, counter.value))

    def __iter__(self) -> Iterator[str]:
        return iter(Counter)

    def __len__(self) -> int:
        return len(fields(self))

    def plus(self, counter: Counter | str, n: int) -> Counters:
        """These counters with `n` more of `counter`."""
        name = Counter(counter).value
        return replace(self, **{name: self[name] + n})

    def as_dict(self) -> dict[str, int]:
        return {c.value: self[c] for c in Counter}

    @property
    def ended(self) -> int:
        """Released groups that have ended, trained or not."""
        return sum(self[c] for c in ENDED)

    @property
    def freed(self) -> int:
        """Released groups that ended untrained."""
        return sum(self[c] for c in FREED)

    def is_balanced(self, in_flight: int) -> bool:
        """Whether every released group is accounted for: ended, or still in flight."""
        return self.prompts_released == self.ended + in_flight


@dataclass(frozen=True)
class Keys:
    """The Redis key names of one run."""

    run_id: str

    @property
    def prefix(self) -> str:
        return f"asyncrl:{self.run_id}:"

    @property
    def prompts(self) -> str:
        return self.prefix + "prompts"

    @property
    def trajectories(self) -> str:
        return self.prefix + "trajectories"

    @property
    def dlq(self) -> str:
        return self.prefix + "dlq"

    @property
    def version(self) -> str:
        return self.prefix + "version"

    @property
    def weights(self) -> str:
        return self.prefix + "weights"

    @property
    def model(self) -> str:
        """JSON of the trainer's model identity (`asyncrl.model_identity`)."""
        return self.prefix + "model"

    @property
    def counters(self) -> str:
        return self.prefix + "counters"

    @property
    def cursor(self) -> str:
        """Hash (seed, epoch, position) of the next prompt to release; moves with each release."""
        return self.prefix + "cursor"

    @property
    def released(self) -> str:
        """Hash of the prompt groups in flight: field = the prompts-stream entry id of a released
        prompt (the `group_id` of its trajectory group), value = "" until a trajectory entry
        claims it, then that entry's id. A group's field goes in the transaction that ends it
        (trained, dropped stale, dead-lettered); see `asyncrl.provenance`."""
        return self.prefix + "released"

    @property
    def last_step(self) -> str:
        """JSON of the trainer's latest step figures, for `asyncrl status`."""
        return self.prefix + "last_step"

    @property
    def trainer_lease(self) -> str:
        """The token of the one trainer that holds the run (`asyncrl.lease`)."""
        return self.prefix + "trainer_lease"

    def state_keys(self) -> list[str]:
        """Every key of the run but the workers' heartbeats: one of them exists once a trainer
        has started on the run."""
        return [
            self.prompts,
            self.trajectories,
            self.dlq,
            self.version,
            self.weights,
            self.counters,
            self.cursor,
            self.released,
            self.last_step,
            self.trainer_lease,
        ]

    def worker(self, role: str, worker_id: str) -> str:
        return f"{self.prefix}workers:{role}:{worker_id}"

    def workers_pattern(self, role: str) -> str:
        return f"{self.prefix}workers:{role}:*"


def read_counters(client: redis.Redis, keys: Keys) -> Counters:
    return Counters.from_hash(client.hgetall(keys.counters))


def read_accounting(client: redis.Redis, keys: Keys) -> tuple[Counters, int]:
    """The counters and `in_flight` (the groups released and not yet ended), read in one
    transaction: they change together."""
    pipe = client.pipeline(transaction=True)
    pipe.hgetall(keys.counters)
    pipe.hlen(keys.released)
    raw, flying = pipe.execute()
    return Counters.from_hash(raw), int(flying)


def run_exists(client: redis.Redis, keys: Keys) -> bool:
    """Whether Redis holds anything of the run: a key of its state or a live worker."""
    if client.exists(*keys.state_keys()):
        return True
    return any(True for role in ROLES for _ in client.scan_iter(match=keys.workers_pattern(role)))


def read_version(client: redis.Redis, keys: Keys) -> int | None:
    """The weights version last published; None before the first."""
    raw = client.get(keys.version)
    return int(raw) if raw is not None else None


def live_workers(client: redis.Redis, keys: Keys) -> dict[str, list[dict[str, Any]]]:
    """Every unexpired heartbeat by role, sorted by id: `id`, `age_s` (seconds since the beat)
    and the `version` it reported."""
    return {
        role: [
            {"id": w["id"], "age_s": w["age_s"], "version": w.get("version")}
            for w in role_workers(client, keys, role)
        ]
        for role in ROLES
    }


def role_workers(client: redis.Redis, keys: Keys, role: str) -> list[dict[str, Any]]:
    """The live workers of `role`, sorted by id: their status fields plus `id` and `age_s`
    (seconds since the last beat)."""
    prefix = keys.worker(role, "")
    names = sorted(_text(k) for k in client.scan_iter(match=keys.workers_pattern(role), count=1000))
    if not names:
        return []
    values = cast(list[bytes | None], client.mget(names))
    now = time.time()
    workers = []
    for name, raw in zip(names, values, strict=True):
        if raw is None:
            continue  # expired between SCAN and MGET
        status = _beat_status(raw)
        if status is None:
            log.warning("ignoring heartbeat %s: not a msgpack status map", name)
            continue
        ts = status.get("ts")
        age = round(now - ts, 3) if isinstance(ts, int | float) else None
        workers.append({**status, "id": name[len(prefix) :], "age_s": age})
    return workers


def _beat_status(raw: bytes) -> dict[str, Any] | None:
    """A heartbeat's status map, or None where the value is not one."""
    if len(raw) > _MAX_BEAT_BYTES:
        return None
    try:
        # raw=False: str keys and values; no object hooks, so nothing but plain data comes out.
        value = msgpack.unpackb(raw, raw=False, strict_map_key=True)
    except (ValueError, msgpack.UnpackException):
        return None
    return value if isinstance(value, dict) else None


def stream_depths(client: redis.Redis, keys: Keys) -> dict[str, dict[str, int]]:
    """Per stream its `length`, and for the two queues the `lag` and `pending` of the group that
    reads them (`stream_stats`)."""
    return {
        "prompts": stream_stats(client, keys.prompts, PROMPTS_GROUP),
        "trajectories": stream_stats(client, keys.trajectories, TRAJECTORIES_GROUP),
        "dlq": {"length": int(client.xlen(keys.dlq))},
    }


def stream_stats(client: redis.Redis, stream: str, group: str) -> dict[str, int]:
    """`length` of the stream, `lag` (entries the group has not been handed yet) and `pending`
    (handed out, not acked) — the figures `asyncrl status` shows per stream."""
    from redis import exceptions as rx

    try:
        groups = client.xinfo_groups(stream)
    except rx.ResponseError:
        return {"length": 0, "lag": 0, "pending": 0}
    length = int(client.xlen(stream))
    info = next((g for g in groups if _text(g["name"]) == group), None)
    if info is None:
        # The group will be created at id 0: everything in the stream is still ahead of it.
        return {"length": length, "lag": length, "pending": 0}
    lag = info.get("lag")  # Redis ≥ 7; None there when deletions make it unknowable
    if lag is None:
        last = _text(info["last-delivered-id"])
        lag = client.eval(_COUNT_AFTER_LUA, 1, stream, last)
    return {"length": length, "lag": int(lag), "pending": int(info["pending"])}


def _text(x: bytes | str) -> str:
    return x.decode() if isinstance(x, bytes) else x
