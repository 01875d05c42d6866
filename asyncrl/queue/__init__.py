"""The durable queue: Redis streams read through consumer groups (DESIGN §3, §9).

Delivery is at least once; the effect of an entry is exactly once because everything a consumer
does with an entry is committed by `Consumer.ack` in one server-side transaction that first checks
that this consumer still owns the entry. The rules:

- A consumer that (re)starts under the same name first gets the entries it still holds (its own
  pending entries), then new ones.
- Entries of a consumer whose heartbeat has expired are taken over once they have been idle for
  `claim_idle_s` (XPENDING with IDLE, filtered by `is_alive`, then XCLAIM; never a blind
  XAUTOCLAIM). Entries of a live consumer are never taken, however long it holds them: the
  trainer keeps its entries unacked until a checkpoint that includes them is durable. After a
  Redis outage a consumer waits `claim_idle_s` before claiming, so that live peers whose
  heartbeats lapsed while Redis was down can beat again.
- An entry delivered more than `max_deliveries` times, deleted while pending, or rejected by the
  decoder goes to the dead-letter stream with a reason, and is acked, in one transaction.
- Where entries belong to groups kept open in a hash (`Groups`: the run's released prompt
  groups), an entry whose group is not open, or is claimed by another entry, is dead-lettered
  on delivery; acks and dead letters end the group in the same transaction.
- A worker that stops without acking (SIGTERM, crash) leaves its entries pending: it gets them
  back if it restarts under its name, otherwise another consumer takes them over once its
  heartbeat has expired. There is no explicit release.
- Streams are trimmed only below what every group has acked.
- Every call survives Redis outages (reconnect with capped backoff) and a full Redis (producers
  pause below `maxmemory`); neither raises. `should_stop` ends such a wait with `Stopped`.
- Dead letters are for inspection, not a second queue: each keeps a bounded prefix of its entry
  and the stream only the newest ones. A full Redis takes them without the entry's fields (or
  not at all), never making them wait: acking junk is how memory is freed.
- A consumer group that vanished (Redis restarted empty) fails no call: acks of the entries it
  held are not applied, and the next read recreates it.

redis is imported lazily: the config tree imports `QueueConfig`, and `asyncrl --help` must not pay
for redis-py.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Any, Generic, TypeVar, cast

from pydantic import Field

from asyncrl.configbase import Section
from asyncrl.runstate import Counter

if TYPE_CHECKING:
    import redis
    from redis.commands.core import Script

log = logging.getLogger(__name__)

T = TypeVar("T")
R = TypeVar("R")

# What XADD accepts as an entry; what comes back from a client without decode_responses is
# dict[bytes, bytes].
EntryFields = Mapping[str | bytes, bytes | str | int | float]
RawFields = dict[bytes, bytes]
_Fields = dict[str | bytes, bytes | str | int | float]  # an entry being built

# What a dead letter that ends its group counts, and what one that ends none (junk, a duplicate).
_DEAD_LETTER_COUNTERS = (Counter.GROUPS_DEAD_LETTERED.value, Counter.ENTRIES_REJECTED.value)

_DLQ_META = (b"stream", b"id", b"reason", b"detail", b"orig_bytes", b"orig_sha256")
_DETAIL_MAX = 1000
# Fields a dead letter copies at most: the transaction script unpacks them onto Lua's stack.
_DLQ_MAX_FIELDS = 64
# How Redis says it is full; 6.2 wraps it in a generic script error ("-OOM command not ...").
_OOM_MESSAGE = "OOM command not allowed"
_GONE = -2  # `_transact` status: the consumer group (or the whole stream) no longer exists
_LOG_EVERY_S = 5.0
_FULL_WAIT_MAX_S = 0.5  # backpressure polls faster than reconnects: memory frees in bursts
_MEMORY_SAMPLE_S = 0.5
_SCAN_PAGE = 500


class QueueConfig(Section):
    claim_idle_s: float = Field(default=30.0, gt=0)
    """An entry pending this long on a consumer whose heartbeat has expired is taken over by
    another consumer. Entries of live consumers are never taken, however long they are held."""
    max_deliveries: int = Field(default=5, ge=1)
    """An entry delivered more often than this (a crash loop, a poison input) is dead-lettered."""
    claim_every_s: float = Field(default=5.0, gt=0)
    """How often a consumer scans its group for entries of dead consumers."""
    trim_every_s: float = Field(default=10.0, gt=0)
    """How often a consumer trims the entries that every group has acked."""
    memory_high_watermark: float = Field(default=0.9, gt=0, le=1)
    """Fraction of Redis `maxmemory` at which producers pause until consumers catch up (read by
    INFO: off, with a log line, for a Redis user the ACL refuses it)."""
    max_message_bytes: int = Field(default=64 * 2**20, ge=1)
    """Largest entry (sum of its field sizes) a producer may add; a bigger one is a caller error."""
    dead_letter_payload_bytes: int = Field(default=64 * 2**10, ge=0)
    """Bytes of a dead-lettered entry's fields (names and values, in order) its dead letter keeps;
    the field that crosses the bound keeps a prefix, later ones are left out. `orig_bytes` and
    `orig_sha256` in the dead letter describe the whole entry."""
    dead_letter_max_entries: int = Field(default=1000, ge=1)
    """Length cap of the dead-letter stream: beyond it the oldest dead letters are trimmed. With
    `dead_letter_payload_bytes` it bounds the stream's memory (about 64 MiB by default)."""


@dataclass(frozen=True, slots=True)
class Groups(Generic[T]):
    """The hash of open groups that a stream's entries belong to: field = group, value = "" while
    unclaimed, else the id of the entry that claimed it (the run's `released` hash, see
    `asyncrl.provenance`).

    On delivery an entry whose group is not open is dead-lettered as `unreleased`, one whose group
    another entry claimed as `duplicate`; where `claims`, an unclaimed group is claimed for the
    entry. A dead letter ends the entry's group if it is unclaimed or the entry's own, counted
    `groups_dead_lettered`; otherwise (junk, a duplicate) it counts `entries_rejected`. Where
    `claims`, acks end their entries' groups too; elsewhere a group lives on in the entry that an
    ack adds (a worker's publish)."""

    key: str
    group_of: Callable[[str, RawFields | None, T | None], str | None]
    """The group of an entry: from its id, its fields (None: deleted while pending) and its
    decoded value (None where it was not decoded); None when it names none."""
    claims: bool


class Stopped(Exception):
    """`should_stop` turned true while a call was waiting for Redis (an outage or a full Redis)."""


@dataclass(frozen=True, slots=True)
class Delivery(Generic[T]):
    """One stream entry handed to a consumer; it stays pending until acked."""

    id: str
    """Stream entry id, e.g. `1700000000000-0`; pass it to `Consumer.ack`."""
    fields: RawFields
    """The entry as stored."""
    value: T
    """`decode(fields)`, or `fields` when the consumer has no decoder."""
    deliveries: int
    """How often the entry has been delivered, this time included: above 1 it is a redelivery."""


class RedisGuard:
    """Runs a Redis call until it succeeds, waiting out outages and a full Redis.

    Outages (connection refused or reset, timeouts, a server still loading its AOF) are retried
    with exponential backoff capped at `reconnect_max_s`; `on_outage(True)` and `on_outage(False)`
    mark the start and end of each, so metrics can show Redis being down, and `outages` counts
    them. A refused password or ACL is raised at once, not waited out. A full Redis (an OOM reply,
    or memory above the watermark of a `MemoryGauge`) pauses the call the same way. Waits log at
    most every few seconds and poll `should_stop`, which ends them with `Stopped`: it is asked only
    once an attempt has failed, so a stopping role still makes its last calls to a healthy Redis,
    but does not wait out an outage. Threads may
    share a guard (the trainer's reader and main loop do): an outage is counted once, started by
    the first call that fails and ended by the first that succeeds.
    """

    def __init__(
        self,
        *,
        reconnect_max_s: float = 5.0,
        should_stop: Callable[[], bool] | None = None,
        on_outage: Callable[[bool], None] | None = None,
    ) -> None:
        from redis import exceptions as rx

        self._transient: tuple[type[Exception], ...] = (rx.ConnectionError, rx.TimeoutError)
        # redis-py derives these from ConnectionError, but a refused password or ACL stays
        # refused: retrying would turn a configuration error into a silent hang.
        self._refused: tuple[type[Exception], ...] = (
            rx.AuthenticationError,
            rx.AuthorizationError,
        )
        self._response = rx.ResponseError
        self._max_s = reconnect_max_s
        self._should_stop = should_stop
        self._on_outage = on_outage
        self._next_log = 0.0  # shared by all calls: a producer pausing at every add logs rarely
        self._lock = threading.Lock()
        self.outages = 0
        self.down = False
        """True while the current call is failing because Redis is unreachable."""

    def call(
        self,
        fn: Callable[[], R],
        what: str,
        *,
        memory: MemoryGauge | None = None,
        on_retry: Callable[[bool], None] | None = None,
    ) -> R:
        """`fn()`, retried until it succeeds. Before each retry `on_retry(outage)` learns whether
        the failed attempt was an outage (True: its outcome is unknown) or a full Redis (False)."""
        delay = 0.05
        started = time.monotonic()
        waiting = False
        while True:
            if waiting and self._should_stop is not None and self._should_stop():
                raise Stopped(what)
            waiting = True
            try:
                if memory is None or not memory.full():
                    result = fn()
                    break
                reason = f"Redis memory above {memory.watermark:.0%} of maxmemory"
                outage = False
            except self._refused:
                raise
            except self._transient as exc:
                reason, outage = f"Redis unreachable ({type(exc).__name__}: {exc})", True
                self._mark_down(True, what, started)
            except self._response as exc:
                if not is_oom(exc):
                    raise
                reason, outage = "Redis is out of memory", False
            now = time.monotonic()
            if now >= self._next_log:
                verb = "retrying" if outage else "pausing"
                log.warning("%s: %s; %s (%.0fs so far)", what, reason, verb, now - started)
                self._next_log = now + _LOG_EVERY_S
            if on_retry is not None:
                on_retry(outage)
            self._sleep(delay)
            delay = min(delay * 2, self._max_s if outage else _FULL_WAIT_MAX_S)
        if self.down:
            self._mark_down(False, what, started)
        return result

    def _mark_down(self, down: bool, what: str, started: float) -> None:
        with self._lock:
            if self.down == down:
                return  # another thread saw this transition first
            self.down = down
            if down:
                self.outages += 1
            else:
                log.warning(
                    "%s: Redis reachable again after %.1fs", what, time.monotonic() - started
                )
            if self._on_outage is not None:
                self._on_outage(down)

    def _sleep(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        while (left := end - time.monotonic()) > 0:
            if self._should_stop is not None and self._should_stop():
                return
            time.sleep(min(left, 0.1))


def is_oom(exc: Exception) -> bool:
    """Whether a Redis error says that Redis is full (`maxmemory` reached, nothing to evict)."""
    from redis import exceptions as rx

    return isinstance(exc, rx.OutOfMemoryError) or _OOM_MESSAGE in str(exc)


class MemoryGauge:
    """Whether Redis memory is above `watermark` × maxmemory.

    INFO is sampled at most every 0.5 s, plus whenever the bytes this process has added since the
    last sample would cross the watermark: a fast producer must not overshoot it between samples.
    A user the ACL refuses INFO (it is @dangerous, and no other permitted command tells
    maxmemory) leaves the gauge unknown, never full: Redis's own out-of-memory refusal, which
    `RedisGuard` waits out, is then the only brake.
    """

    def __init__(self, client: redis.Redis, watermark: float) -> None:
        self._client = client
        self.watermark = watermark
        self._used = 0
        self._limit = 0.0  # 0: no maxmemory (or unknown), never full
        self._added = 0
        self._next_sample = 0.0

    def full(self) -> bool:
        now = time.monotonic()
        near = self._limit and self._used + self._added >= self._limit
        if now >= self._next_sample or near:
            self._sample(now)
        return bool(self._limit) and self._used + self._added >= self._limit

    def _sample(self, now: float) -> None:
        from redis.exceptions import NoPermissionError

        try:
            info = self._client.info("memory")
        except NoPermissionError:
            log.warning(
                "redis: this user may not run INFO; queue.memory_high_watermark is off (memory "
                "unknown), writes pause only when Redis itself refuses them for memory"
            )
            self._next_sample = float("inf")
            return
        self._used = int(info["used_memory"])
        self._limit = self.watermark * int(info.get("maxmemory", 0))
        self._added = 0
        self._next_sample = now + _MEMORY_SAMPLE_S

    def added(self, nbytes: int) -> None:
        self._added += nbytes


# Commit what a consumer did with entries, atomically, if and only if it still owns them.
# KEYS: source stream, counters hash, groups hash, then one stream per entry to add.
# ARGV: group, consumer, n_ids, n_counters, n_adds, n_ends, ended, other, ids...,
#       (field, increment)..., then per added entry: n_pairs, (name, value)...,
#       then per group to end: (group, entry id)...
# Returns {1, added ids...} when applied, {0} if an id is no longer pending (already acked),
# {-1} if another consumer owns it now. Adds come first: the first write is the only one Redis
# may refuse for memory, so a full Redis rejects the whole transaction and leaves nothing
# half-written, while a plain ack (whose XACK is never refused) still frees memory. A group to
# end leaves the groups hash if it is unclaimed or claimed by that entry; the counter `ended`
# counts those, `other` the rest ("" counts nothing): so a dead letter frees admission budget
# only where it ends a released group.
_TRANSACT_LUA = """
local stream, counters, groups = KEYS[1], KEYS[2], KEYS[3]
local group, consumer = ARGV[1], ARGV[2]
local n_ids, n_counters, n_adds = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
local n_ends, ended, other = tonumber(ARGV[6]), ARGV[7], ARGV[8]
for i = 9, 8 + n_ids do
  local id = ARGV[i]
  if #redis.call('XPENDING', stream, group, id, id, 1, consumer) == 0 then
    if #redis.call('XPENDING', stream, group, id, id, 1) == 0 then return {0} end
    return {-1}
  end
end
local reply = {1}
local a = 9 + n_ids + 2 * n_counters
for k = 1, n_adds do
  local n = tonumber(ARGV[a])
  reply[k + 1] = redis.call('XADD', KEYS[3 + k], '*', unpack(ARGV, a + 1, a + 2 * n))
  a = a + 1 + 2 * n
end
for i = 9, 8 + n_ids, 1000 do
  redis.call('XACK', stream, group, unpack(ARGV, i, math.min(i + 999, 8 + n_ids)))
end
for c = 9 + n_ids, 8 + n_ids + 2 * n_counters, 2 do
  redis.call('HINCRBY', counters, ARGV[c], ARGV[c + 1])
end
local n_ended = 0
for e = a, a + 2 * n_ends - 1, 2 do
  local owner = redis.call('HGET', groups, ARGV[e])
  if owner == '' or owner == ARGV[e + 1] then
    redis.call('HDEL', groups, ARGV[e])
    n_ended = n_ended + 1
  end
end
if ended ~= '' and n_ended > 0 then redis.call('HINCRBY', counters, ended, n_ended) end
if other ~= '' and n_ends > n_ended then
  redis.call('HINCRBY', counters, other, n_ends - n_ended)
end
return reply
"""

# Whether delivered entries may be worked on. KEYS: groups hash. ARGV: claim ("1" or "0"), then
# (group, entry id) pairs. Per pair: "" when the group is open and unclaimed or claimed by that
# entry (a redelivery), "unreleased" when it is not open (never opened, or ended), "duplicate"
# when another entry claimed it. With claim "1" an unclaimed group is claimed for its entry.
_ADMIT_LUA = """
local out = {}
for i = 2, #ARGV, 2 do
  local owner = redis.call('HGET', KEYS[1], ARGV[i])
  if not owner then
    out[#out + 1] = 'unreleased'
  elseif owner == ARGV[i + 1] then
    out[#out + 1] = ''
  elseif owner ~= '' then
    out[#out + 1] = 'duplicate'
  else
    if ARGV[1] == '1' then
      -- HDEL first: Redis never refuses it for memory, and a script that has written is let
      -- write on, so a full Redis does not stall the reader whose acks would free it.
      redis.call('HDEL', KEYS[1], ARGV[i])
      redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1])
    end
    out[#out + 1] = ''
  end
end
return out
"""

# Settle entries one by one with an outcome. KEYS: stream, counters, groups hash. ARGV: group,
# consumer, outcome counter, n_ids, ids..., then (group, entry id) pairs. An id pending on this
# consumer is acked, counted and ends its group; one the stream no longer has at all (neither
# entry nor pending: Redis lost its data since it was read) is counted and ends its group only
# where that group names it (admission opened it again for its holder when it found the loss);
# any other (acked already, or taken over) is left. pcall: after a loss the group may not exist
# yet, and every id is then gone. Returns the number counted.
_SETTLE_LUA = """
local stream, counters, groups = KEYS[1], KEYS[2], KEYS[3]
local group, consumer, outcome = ARGV[1], ARGV[2], ARGV[3]
local n = tonumber(ARGV[4])
local group_of = {}
for e = 5 + n, #ARGV, 2 do group_of[ARGV[e + 1]] = ARGV[e] end
local counted = 0
for i = 5, 4 + n do
  local id = ARGV[i]
  local g = group_of[id]
  local own = redis.pcall('XPENDING', stream, group, id, id, 1, consumer)
  if type(own) == 'table' and #own == 1 then
    redis.call('XACK', stream, group, id)
    counted = counted + 1
    if g and redis.call('HGET', groups, g) == '' then redis.call('HDEL', groups, g) end
  elseif g and #redis.call('XRANGE', stream, id, id) == 0 then
    local any = redis.pcall('XPENDING', stream, group, id, id, 1)
    if (type(any) ~= 'table' or #any == 0) and redis.call('HGET', groups, g) == id then
      counted = counted + 1
    end
  end
  if g and redis.call('HGET', groups, g) == id then redis.call('HDEL', groups, g) end
end
if counted > 0 then redis.call('HINCRBY', counters, outcome, counted) end
return counted
"""

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


# Add entries that each open a group, counted, with a state hash written beside them, while the
# counter still reads what the caller read. KEYS: stream, counters hash, groups hash, state hash.
# ARGV: counter, expected count, n_entries, n_state, (name, value) of the state..., then per
# entry: n_pairs, (name, value).... Returns 1 when applied, 0 if the counter had moved (a retry
# whose first attempt was applied, or a Redis that lost the counter). An XADD is the first write,
# the only one Redis may refuse for memory: a full Redis rejects the whole transaction.
_ADD_COUNTED_LUA = """
local counters, counter = KEYS[2], ARGV[1]
if tonumber(redis.call('HGET', counters, counter) or 0) ~= tonumber(ARGV[2]) then return 0 end
local n, n_state = tonumber(ARGV[3]), tonumber(ARGV[4])
local a = 5 + 2 * n_state
for k = 1, n do
  local m = tonumber(ARGV[a])
  local id = redis.call('XADD', KEYS[1], '*', unpack(ARGV, a + 1, a + 2 * m))
  redis.call('HSET', KEYS[3], id, '')
  a = a + 1 + 2 * m
end
redis.call('HINCRBY', counters, counter, n)
if n_state > 0 then redis.call('HSET', KEYS[4], unpack(ARGV, 5, 4 + 2 * n_state)) end
return 1
"""


def _transact(
    script: Script,
    *,
    stream: str,
    group: str = "",
    consumer: str = "",
    ids: list[str],
    counters_key: str | None,
    counters: Mapping[str, int],
    adds: list[tuple[str, EntryFields]],
    groups_key: str | None = None,
    ends: list[tuple[str, str]] | None = None,
    end_counters: tuple[str, str] = ("", ""),
) -> tuple[int, list[str]]:
    ends = ends or []
    keys = [stream, counters_key or stream, groups_key or stream, *(s for s, _ in adds)]
    args: list[Any] = [group, consumer, len(ids), len(counters), len(adds), len(ends)]
    args += [*end_counters, *ids]
    for name, increment in counters.items():
        args += [name, int(increment)]
    for _, fields in adds:
        args.append(len(fields))
        for k, v in fields.items():
            args += [k, v]
    for group_field, owner in ends:
        args += [group_field, owner]
    reply = script(keys=keys, args=args)
    return int(reply[0]), [_str(x) for x in reply[1:]]


def dead_letter_payload(fields: RawFields, budget: int) -> _Fields:
    """The fields of an entry as its dead letter keeps them: in order while names and values
    together fit `budget` bytes (and at most `_DLQ_MAX_FIELDS`); the value that crosses the bound
    keeps a prefix, later fields are left out. Fields named like dead-letter metadata are renamed
    `orig.NAME`."""
    kept: _Fields = {}
    for k, v in fields.items():
        budget -= len(k)
        if budget < 0 or len(kept) == _DLQ_MAX_FIELDS:
            break
        kept[b"orig." + k if k in _DLQ_META else k] = v[:budget]
        budget -= min(len(v), budget)
    return kept


def dead_letter_summary(fields: RawFields) -> _Fields:
    """Size and digest of a whole entry, so that a dead letter holding only part of it still
    tells entries apart: `orig_bytes` (names and values) and `orig_sha256` (of the names and
    values in order, each preceded by its length as 8 bytes big-endian)."""
    digest = hashlib.sha256()
    size = 0
    for k, v in fields.items():
        for part in (k, v):
            digest.update(len(part).to_bytes(8, "big"))
            digest.update(part)
            size += len(part)
    return {b"orig_bytes": size, b"orig_sha256": digest.hexdigest().encode()}


def entry_size(fields: EntryFields, limit: int) -> int:
    """The size a stream entry counts for (its field values); ValueError above `limit`."""
    size = sum(len(v) if isinstance(v, bytes | str) else 8 for v in fields.values())
    if size > limit:
        raise ValueError(f"stream entry of {size} bytes exceeds queue.max_message_bytes={limit}")
    return size


def _check_client(client: redis.Redis, block_ms: int | None = None) -> None:
    kwargs = client.connection_pool.connection_kwargs
    if kwargs.get("decode_responses"):
        raise ValueError("the queue needs a client without decode_responses: payloads are bytes")
    timeout = kwargs.get("socket_timeout")
    if block_ms and timeout is not None and block_ms / 1000 >= timeout:
        raise ValueError(f"block_ms={block_ms} must stay below the socket timeout ({timeout}s)")


def _str(x: bytes | str) -> str:
    return x.decode() if isinstance(x, bytes) else x


def _pending(
    client: redis.Redis,
    stream: str,
    group: str,
    start: str,
    count: int,
    *,
    consumer: str | None = None,
    idle_ms: int | None = None,
) -> list[tuple[str, str, int]]:
    """(id, owner, times delivered) of up to `count` pending entries from `start` on."""
    page = cast(
        list[dict[str, Any]],
        client.xpending_range(
            stream, group, start, "+", count, consumername=consumer, idle=idle_ms
        ),
    )
    return [(_str(p["message_id"]), _str(p["consumer"]), int(p["times_delivered"])) for p in page]


def _id_key(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


class _StreamClient:
    """What a producer and a consumer of one stream share: the client, the config, a guard that
    waits out outages and a full Redis, and the transaction script."""

    def __init__(
        self,
        client: redis.Redis,
        stream: str,
        cfg: QueueConfig | None = None,
        *,
        reconnect_max_s: float = 5.0,
        should_stop: Callable[[], bool] | None = None,
        on_outage: Callable[[bool], None] | None = None,
    ) -> None:
        _check_client(client)
        self._client = client
        self.stream = stream
        self._cfg = cfg or QueueConfig()
        self._guard = RedisGuard(
            reconnect_max_s=reconnect_max_s, should_stop=should_stop, on_outage=on_outage
        )
        self._memory = MemoryGauge(client, self._cfg.memory_high_watermark)
        self._script = client.register_script(_TRANSACT_LUA)

    @property
    def outages(self) -> int:
        """Redis outages this producer or consumer has waited through."""
        return self._guard.outages


class Producer(_StreamClient):
    """Adds entries to a stream. Never trims: unconsumed entries are the queue.

    `add` is at least once: if the connection drops after Redis ran the XADD but before the reply
    arrived, the retry adds a second entry. A duplicate is a separate entry with its own id, and
    the counters were incremented with it in the same transaction, so run accounting stays
    balanced.
    """

    @cached_property
    def _counted_script(self) -> Script:
        return self._client.register_script(_ADD_COUNTED_LUA)

    def add(
        self,
        fields: EntryFields,
        *,
        counters: Mapping[str, int] | None = None,
        counters_key: str | None = None,
    ) -> str:
        """Append one entry (and increment `counters` in the same transaction); its id.

        Blocks while Redis is unreachable or its memory is above the watermark.
        """
        size = entry_size(fields, self._cfg.max_message_bytes)
        if counters and counters_key is None:
            raise ValueError("counters need a counters_key")
        entry: dict[Any, Any] = dict(fields)

        def once() -> str:
            if not counters:
                return _str(cast(bytes, self._client.xadd(self.stream, entry)))
            _, added = _transact(
                self._script,
                stream=self.stream,
                ids=[],
                counters_key=counters_key,
                counters=counters,
                adds=[(self.stream, fields)],
            )
            return added[0]

        entry_id = self._guard.call(once, f"add to {self.stream}", memory=self._memory)
        self._memory.added(size)
        return entry_id

    def add_counted(
        self,
        entries: Sequence[EntryFields],
        *,
        counters_key: str,
        counter: str,
        expected: int,
        groups_key: str,
        state: tuple[str, Mapping[str, int]],
    ) -> bool:
        """Append `entries`, open a group for each in `groups_key` (named by its entry id, as
        `Groups` reads it), add their number to `counter` and write the `state` hash (key,
        fields): in one transaction, applied only while `counter` still reads `expected`.

        True when applied — by this call, or by an attempt whose reply was lost in an outage (the
        retry then finds the counter moved and applies nothing twice). False when nothing was
        added: Redis is full (above the watermark, or refusing writes) — a caller that must not
        wait, such as the trainer's admission, whose reads are what frees memory, tries again
        later — or the counter had moved already (Redis lost it: the caller reads it again).
        Waits out outages.
        """
        from redis import exceptions as rx

        size = sum(entry_size(fields, self._cfg.max_message_bytes) for fields in entries)
        key, values = state
        args: list[Any] = [counter, expected, len(entries), len(values)]
        for name, value in values.items():
            args += [name, value]
        for fields in entries:
            args.append(len(fields))
            for k, v in fields.items():
                args += [k, v]
        outcome_unknown = False

        def on_retry(outage: bool) -> None:
            nonlocal outcome_unknown
            outcome_unknown |= outage

        def attempt() -> int | None:
            # After a lost reply the script runs whatever the gauge says: it tells whether the
            # lost attempt was applied without writing anything if it was.
            if not outcome_unknown and self._memory.full():
                return None
            try:
                reply = self._counted_script(
                    keys=[self.stream, counters_key, groups_key, key], args=args
                )
            except rx.ResponseError as exc:
                if is_oom(exc):
                    return None
                raise
            return int(cast(int, reply))

        applied = self._guard.call(attempt, f"add to {self.stream}", on_retry=on_retry)
        if applied is None:
            return False
        self._memory.added(size)
        return applied == 1 or outcome_unknown


# (entry id, fields or None when the entry was deleted while pending, times delivered)
_Raw = tuple[str, RawFields | None, int]


class Consumer(_StreamClient, Generic[T]):
    """One named member of a consumer group. Not thread-safe: one reading thread per consumer.

    `is_alive(name)` says whether another consumer's heartbeat is current (see
    `asyncrl.heartbeat.is_alive`); consumer names are worker ids. `decode` turns fields into the
    value handed out; an exception it raises with a `reason` attribute, or any ValueError,
    dead-letters the entry instead of failing the read. With `groups`, entries are checked
    against (and claim) their group on delivery, and end it when acked or dead-lettered.
    """

    def __init__(
        self,
        client: redis.Redis,
        stream: str,
        group: str,
        name: str,
        cfg: QueueConfig | None = None,
        *,
        dlq: str,
        counters_key: str,
        is_alive: Callable[[str], bool],
        decode: Callable[[RawFields], T] | None = None,
        groups: Groups[T] | None = None,
        reconnect_max_s: float = 5.0,
        should_stop: Callable[[], bool] | None = None,
        on_outage: Callable[[bool], None] | None = None,
    ) -> None:
        super().__init__(
            client,
            stream,
            cfg,
            reconnect_max_s=reconnect_max_s,
            should_stop=should_stop,
            on_outage=on_outage,
        )
        self.group = group
        self._groups = groups
        self._admit_script = client.register_script(_ADMIT_LUA)
        self._settle_script = client.register_script(_SETTLE_LUA)
        # Group of each held entry of a claiming consumer, for its ack to end.
        self._held_groups: dict[str, str] = {}
        self.name = name
        self._dlq = dlq
        self._counters_key = counters_key
        self._is_alive = is_alive
        self._decode = decode
        self._group_ready = False
        # Ids handed out and not yet acked. Scans of our own pending entries skip them, so an
        # entry is never handed out twice by one process.
        self._held: set[str] = set()
        # Cursor over our own pending entries; None once they have all been handed out.
        self._own_from: str | None = "-"
        now = time.monotonic()
        self._next_claim = now
        self._next_trim = now + self._cfg.trim_every_s

    def read(self, count: int = 1, block_ms: int = 1000) -> list[Delivery[T]]:
        """Up to `count` entries: own pending ones first, then dead consumers' (every
        `claim_every_s`), then new ones, waiting up to `block_ms` for those. Dead-lettered entries
        are not returned. Blocks while Redis is unreachable."""
        _check_client(self._client, block_ms)
        try:
            return self._guard.call(
                lambda: self._read_once(count, block_ms),
                f"read from {self.stream}",
                on_retry=self._after_failure,
            )
        except Exception:
            # Say a decoder bug raised: the entries this read took are pending on us but were not
            # handed out. A caller that carries on gets them again (and a poison entry reaches
            # max_deliveries) instead of leaving them stranded until a restart.
            self._own_from = "-"
            raise

    def ack(
        self,
        ids: Iterable[str],
        *,
        counters: Mapping[str, int] | None = None,
        also_add: list[tuple[str, EntryFields]] | None = None,
    ) -> bool:
        """Ack `ids`, add the `also_add` entries and increment `counters`: all or nothing, in one
        transaction that runs only while every id is still pending for this consumer.

        True when applied — by this call, or by an attempt whose reply was lost in an outage (the
        retry then finds the ids acked and does not apply it again). False when an id was already
        acked, or is now owned by another consumer that took it over while this one's heartbeat
        had lapsed, or the group is gone with its entries (Redis restarted empty); nothing is
        applied then. Blocks while Redis is unreachable, and while its memory is above the
        watermark if there is something to add.
        """
        ids = list(ids)
        adds = also_add or []
        size = sum(entry_size(fields, self._cfg.max_message_bytes) for _, fields in adds)
        outcome_unknown = False

        def on_retry(outage: bool) -> None:
            nonlocal outcome_unknown
            outcome_unknown |= outage

        def attempt() -> tuple[int, list[str]]:
            ends = self._ends(ids) if self._groups is not None and self._groups.claims else []
            return self._transact(ids, counters or {}, adds, ends)

        status, _ = self._guard.call(
            attempt,
            f"ack on {self.stream}",
            memory=self._memory if adds else None,
            on_retry=on_retry,
        )
        self._held.difference_update(ids)
        for i in ids:
            self._held_groups.pop(i, None)
        self._memory.added(size)
        if status == 1 or (status == 0 and outcome_unknown):
            return True
        if status == _GONE:
            return False  # `_group_gone` said so
        log.warning(
            "%s: ack of %d entries on %s not applied: %s",
            self.name,
            len(ids),
            self.stream,
            "already acked" if status == 0 else "taken over by another consumer",
        )
        return False

    def settle(
        self, ids: Iterable[str], outcome: str, *, check: Callable[[], object] | None = None
    ) -> int:
        """Ack each of `ids` still pending on this consumer, counting it as `outcome` (a run
        counter) and ending its group; how many were counted. Unlike `ack`, entry by entry: one
        entry that cannot be acked holds back none of the others. An entry Redis no longer has
        (it came back without its data after the entry was read) is counted as `outcome` too
        where admission opened its group again for it (`held_groups`, when it found the loss):
        the trainer did train it, or drop it. One taken over or acked already is left alone.
        Waits out outages; a retry after a lost reply finds its work done and counts nothing
        twice. `check` runs first in every attempt (admission's look for a loss of Redis's
        data): a Redis that comes back empty while this waits out an outage is found before
        the entries are settled against it, while they are still held."""
        ids = list(ids)
        if not ids:
            return 0

        def attempt() -> int:
            if check is not None:
                check()
            ends = self._ends(ids) if self._groups is not None and self._groups.claims else []
            keys = [self.stream, self._counters_key, self._groups.key if self._groups else "-"]
            args: list[Any] = [self.group, self.name, outcome, len(ids), *ids]
            for group, entry_id in ends:
                args += [group, entry_id]
            return int(cast(int, self._settle_script(keys=keys, args=args)))

        counted = self._guard.call(attempt, f"ack on {self.stream}")
        self._held.difference_update(ids)
        for i in ids:
            self._held_groups.pop(i, None)
        if counted < len(ids):
            log.warning(
                "%s: %d of %d entries on %s not acked: acked already, taken over, or lost with "
                "Redis's data before they were read",
                self.name,
                len(ids) - counted,
                len(ids),
                self.stream,
            )
        return counted

    def drop(self, entry_id: str, outcome: str, *, value: T | None = None) -> bool:
        """Ack an entry whose work is given up for a known cause, not failed (no dead letter):
        its group ends and counts `outcome` (a run counter) where it was still open, in one
        transaction that runs only while the entry is pending for this consumer. True when
        applied. Waits out outages; a full Redis does not hold it back (an ack frees memory)."""
        ends: list[tuple[str, str]] = []
        if self._groups is not None:
            group = self._held_groups.get(entry_id) or self._groups.group_of(entry_id, None, value)
            ends = [] if group is None else [(group, entry_id)]
        status, _ = self._guard.call(
            lambda: self._transact([entry_id], {}, [], ends, (outcome, "")),
            f"drop on {self.stream}",
        )
        self._held.discard(entry_id)
        self._held_groups.pop(entry_id, None)
        return status == 1

    def held_groups(self) -> dict[str, str]:
        """Entry id → group of the entries handed out and not yet acked (a claiming consumer's;
        any thread may ask)."""
        return self._held_groups.copy()

    def _transact(
        self,
        ids: list[str],
        counters: Mapping[str, int],
        adds: list[tuple[str, EntryFields]],
        ends: list[tuple[str, str]] | None = None,
        end_counters: tuple[str, str] = ("", ""),
    ) -> tuple[int, list[str]]:
        from redis import exceptions as rx

        try:
            return _transact(
                self._script,
                stream=self.stream,
                group=self.group,
                consumer=self.name,
                ids=ids,
                counters_key=self._counters_key,
                counters=counters,
                adds=adds,
                groups_key=self._groups.key if self._groups is not None else None,
                ends=ends,
                end_counters=end_counters,
            )
        except rx.ResponseError as exc:
            # The script's first command fails on a missing group: nothing was applied.
            if "NOGROUP" not in str(exc):
                raise
            self._group_gone()
            return _GONE, []

    def _group_gone(self) -> None:
        """The group or the stream vanished (deleted, or Redis lost its data), and with it every
        entry this consumer held: say so once, and recreate the group at the next read."""
        if self._group_ready:
            log.warning(
                "%s: group %s on %s is gone with its pending entries (Redis lost its data?); "
                "acks of them are not applied; recreating it",
                self.name,
                self.group,
                self.stream,
            )
        self._group_ready = False
        self._held.clear()
        self._own_from = "-"

    def _ends(self, ids: list[str]) -> list[tuple[str, str]]:
        """(group, id) of the acked entries. An entry this consumer did not hand out (one a
        restarted trainer acks for its checkpoint) is read back for its group."""
        assert self._groups is not None
        for i in ids:
            if i not in self._held_groups:
                rows = cast(list[tuple[bytes, RawFields]], self._client.xrange(self.stream, i, i))
                group = self._groups.group_of(i, rows[0][1] if rows else None, None)
                if group is not None:
                    self._held_groups[i] = group
        return [(self._held_groups[i], i) for i in ids if i in self._held_groups]

    def _after_failure(self, outage: bool) -> None:
        # Entries read by the failed attempt (a reply lost in transit, or dropped because a
        # dead-letter write failed) sit in our pending list without having been handed out.
        self._own_from = "-"
        if outage:
            # Peers' heartbeats may have lapsed while Redis was down although they are alive:
            # give them time to beat again before judging them dead.
            self._next_claim = max(self._next_claim, time.monotonic() + self._cfg.claim_idle_s)

    def _read_once(self, count: int, block_ms: int) -> list[Delivery[T]]:
        from redis import exceptions as rx

        try:
            if not self._group_ready:
                self._create_group()
            now = time.monotonic()
            if now >= self._next_trim:
                trim_acked(self._client, self.stream)
                self._next_trim = now + self._cfg.trim_every_s
            raw: list[_Raw] = []
            if self._own_from is not None:
                raw = self._own_pending(count)
            if not raw and now >= self._next_claim:
                raw = self._claim_dead(count)
            if not raw:
                raw = self._read_new(count, block_ms)
        except rx.ResponseError as exc:
            if "NOGROUP" not in str(exc):
                raise
            self._group_gone()
            return []
        return self._deliver(raw)

    def _create_group(self) -> None:
        from redis import exceptions as rx

        try:
            # From id 0 with MKSTREAM: a consumer may start before any producer, and entries a
            # producer added before the group existed are still delivered.
            self._client.xgroup_create(self.stream, self.group, id="0", mkstream=True)
        except rx.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise
        self._group_ready = True

    def _own_pending(self, count: int) -> list[_Raw]:
        while self._own_from is not None:
            page = _pending(
                self._client, self.stream, self.group, self._own_from, count, consumer=self.name
            )
            self._own_from = "(" + page[-1][0] if len(page) == count else None
            mine = {i: n for i, _, n in page if i not in self._held}
            if mine:
                # Claiming our own entries re-reads them and counts the delivery, so a consumer
                # that crashes on an entry at every restart ends up dead-lettering it.
                return self._claim(mine, 0)
        return []

    def _claim_dead(self, count: int) -> list[_Raw]:
        idle_ms = int(self._cfg.claim_idle_s * 1000)
        found: dict[str, int] = {}
        owners: dict[str, int] = {}
        start = "-"
        while len(found) < count:
            page = _pending(
                self._client, self.stream, self.group, start, _SCAN_PAGE, idle_ms=idle_ms
            )
            for entry_id, owner, n in page:
                if owner != self.name and not self._is_alive(owner):
                    found[entry_id] = n
                    owners[owner] = owners.get(owner, 0) + 1
                    if len(found) == count:
                        break
            if len(page) < _SCAN_PAGE:
                break
            start = "(" + page[-1][0]
        # A full batch may leave more behind: scan again on the next read.
        now = time.monotonic()
        self._next_claim = now if len(found) == count else now + self._cfg.claim_every_s
        if not found:
            return []
        claimed = self._claim(found, idle_ms)
        log.warning(
            "%s: took over %d entries on %s from dead consumers %s",
            self.name,
            len(claimed),
            self.stream,
            dict(sorted(owners.items())),
        )
        return claimed

    def _claim(self, prev: dict[str, int], min_idle_ms: int) -> list[_Raw]:
        ids = list(prev)
        # min_idle_ms makes the claim lose any race: an entry another consumer has just claimed
        # or re-read is no longer idle.
        reply = cast(
            list[tuple[bytes | None, RawFields | None]],
            self._client.xclaim(self.stream, self.group, self.name, min_idle_ms, list(ids)),
        )
        if len(reply) == len(ids):
            # Every id was claimed, so replies line up with ids; a nil is an entry deleted while
            # pending (Redis 6.2 keeps those in the pending list).
            return [(i, f or None, prev[i] + 1) for i, (_, f) in zip(ids, reply, strict=True)]
        return [(_str(i), f, prev[_str(i)] + 1) for i, f in reply if i is not None and f]

    def _read_new(self, count: int, block_ms: int) -> list[_Raw]:
        reply = cast(
            list[tuple[bytes, list[tuple[bytes, RawFields]]]],
            self._client.xreadgroup(
                self.group, self.name, {self.stream: ">"}, count=count, block=block_ms or None
            ),
        )
        if not reply:
            return []
        return [(_str(i), fields, 1) for i, fields in reply[0][1]]

    def _deliver(self, raw: list[_Raw]) -> list[Delivery[T]]:
        out: list[Delivery[T]] = []
        for entry_id, fields, deliveries in raw:
            if deliveries > self._cfg.max_deliveries:
                self.dead_letter(entry_id, fields, "max_deliveries", f"delivered {deliveries}×")
                continue
            if fields is None:
                self.dead_letter(entry_id, None, "deleted", "entry deleted while pending")
                continue
            try:
                value: Any = fields if self._decode is None else self._decode(fields)
            except Exception as exc:
                reason = getattr(exc, "reason", None)
                if reason is None and not isinstance(exc, ValueError):
                    raise
                self.dead_letter(entry_id, fields, str(reason or "decode_error"), str(exc))
                continue
            out.append(Delivery(entry_id, fields, value, deliveries))
        if self._groups is not None and out:
            out = self._admit(out, self._groups)
        self._held.update(d.id for d in out)
        return out

    def _admit(self, decoded: list[Delivery[T]], groups: Groups[T]) -> list[Delivery[T]]:
        """Those of `decoded` whose group is open (and now claimed by them, where `claims`),
        checked in one round trip; the others are dead-lettered."""
        named = [(d, groups.group_of(d.id, d.fields, d.value)) for d in decoded]
        args: list[Any] = [int(groups.claims)]
        for d, group in named:
            if group is not None:
                args += [group, d.id]
        reply = self._admit_script(keys=[groups.key], args=args) if len(args) > 1 else []
        verdicts = iter(cast(list[bytes], reply))
        out = []
        for d, group in named:
            verdict = "unreleased" if group is None else _str(next(verdicts))
            if not verdict:
                if groups.claims and group is not None:
                    self._held_groups[d.id] = group
                out.append(d)
                continue
            detail = {
                "unreleased": f"group {group!r} is not in flight: never released, or it ended",
                "duplicate": f"group {group!r} is claimed by another entry",
            }[verdict]
            self.dead_letter(d.id, d.fields, verdict, detail, value=d.value)
        return out

    def dead_letter(
        self,
        entry_id: str,
        fields: RawFields | None,
        reason: str,
        detail: str,
        *,
        value: T | None = None,
    ) -> None:
        """Move an entry to the dead-letter stream and ack it, in one transaction that runs only
        while the entry is pending for this consumer; `value` (the decoded entry, if it was)
        helps find its group. Waits out outages.

        The dead letter keeps the first `queue.dead_letter_payload_bytes` of the entry (see
        `dead_letter_payload`), and the stream its newest `queue.dead_letter_max_entries`. A full
        Redis is not waited for: entries that only this consumer can dead-letter may be what
        fills it, and their ack is what frees it. The dead letter then goes without the entry's
        fields, or, should Redis refuse even that, not at all (the log line is what is left).
        """
        entry: _Fields = {
            b"stream": self.stream,
            b"id": entry_id,
            b"reason": reason,
            b"detail": detail[:_DETAIL_MAX],
        }
        if fields is not None:
            entry.update(dead_letter_summary(fields))
        payload = dead_letter_payload(fields or {}, self._cfg.dead_letter_payload_bytes)
        counters: dict[str, int] = {Counter.GROUPS_DEAD_LETTERED: 1}
        ends: list[tuple[str, str]] = []
        if self._groups is not None:
            group = self._held_groups.get(entry_id) or self._groups.group_of(
                entry_id, fields, value
            )
            counters, ends = (
                ({}, [(group, entry_id)])
                if group is not None
                else ({Counter.ENTRIES_REJECTED: 1}, [])
            )
        status, note = self._guard.call(
            lambda: self._dead_letter_once(entry_id, counters, ends, entry, payload),
            f"dead-letter on {self.stream}",
        )
        self._held.discard(entry_id)
        self._held_groups.pop(entry_id, None)
        if status == 1:
            log.warning(
                "%s: dead-lettered %s of %s: %s (%s)%s",
                self.name,
                entry_id,
                self.stream,
                reason,
                detail[:200],
                note,
            )

    def _dead_letter_once(
        self,
        entry_id: str,
        counters: Mapping[str, int],
        ends: list[tuple[str, str]],
        entry: EntryFields,
        payload: EntryFields,
    ) -> tuple[int, str]:
        """One attempt of `dead_letter`: the transaction's status, and a note on what of the
        dead letter a full Redis left out."""
        from redis import exceptions as rx

        records = [(entry, "; Redis is full: the dead letter keeps none of the entry's fields")]
        if not self._memory.full():
            records.insert(0, ({**entry, **payload}, ""))
        for record, note in records:
            try:
                status, _ = self._transact(
                    [entry_id], counters, [(self._dlq, record)], ends, _DEAD_LETTER_COUNTERS
                )
            except rx.ResponseError as exc:
                if not is_oom(exc):
                    raise
                continue
            if status == 1:
                self._client.xtrim(
                    self._dlq, maxlen=self._cfg.dead_letter_max_entries, approximate=False
                )
            return status, note
        # Not even that fits: a plain ack, whose XACK Redis never refuses, frees the entry.
        status, _ = self._transact([entry_id], counters, [], ends, _DEAD_LETTER_COUNTERS)
        return status, "; Redis is full: no dead letter written"


def trim_acked(client: redis.Redis, stream: str) -> int:
    """Delete the entries every group of `stream` is done with; the number deleted.

    The floor is, over all groups, the oldest pending id, or the entry after the last delivered
    one where nothing is pending. Pending and undelivered entries are never deleted, and a stream
    without groups is left alone (its entries await their first consumer).
    """
    from redis import exceptions as rx

    try:
        groups = client.xinfo_groups(stream)
    except rx.ResponseError:
        return 0  # no such stream
    floor: tuple[int, int] | None = None
    for g in groups:
        oldest = None
        if g["pending"]:
            oldest = client.xpending(stream, g["name"])["min"]
        if oldest is not None:
            need = _id_key(_str(oldest))
        else:
            ms, seq = _id_key(_str(g["last-delivered-id"]))
            need = (ms, seq + 1)
        floor = need if floor is None else min(floor, need)
    if floor is None:
        return 0
    # Exact rather than `~`: XLEN stays true for `asyncrl status`, and a trim every few seconds
    # costs next to nothing either way.
    return int(client.xtrim(stream, minid=f"{floor[0]}-{floor[1]}", approximate=False))


def stream_stats(client: redis.Redis, stream: str, group: str) -> dict[str, int]:
    """`length` of the stream, `lag` (entries the group has not been handed yet) and `pending`
    (handed out, not acked) — the figures `asyncrl status` shows per stream."""
    from redis import exceptions as rx

    try:
        groups = client.xinfo_groups(stream)
    except rx.ResponseError:
        return {"length": 0, "lag": 0, "pending": 0}
    length = int(client.xlen(stream))
    info = next((g for g in groups if _str(g["name"]) == group), None)
    if info is None:
        # The group will be created at id 0: everything in the stream is still ahead of it.
        return {"length": length, "lag": length, "pending": 0}
    lag = info.get("lag")  # Redis ≥ 7; None there when deletions make it unknowable
    if lag is None:
        last = _str(info["last-delivered-id"])
        lag = client.eval(_COUNT_AFTER_LUA, 1, stream, last)
    return {"length": length, "lag": int(lag), "pending": int(info["pending"])}
