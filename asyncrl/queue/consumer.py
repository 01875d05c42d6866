"""`Consumer`: one named member of a consumer group — what it reads (its own pending entries,
then dead consumers', then new ones), claims and hands out; its `Settler` commits what it did
with them. Also `trim_acked`, which every consumer runs now and then."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Generic, TypeVar, cast

from asyncrl.queue.config import QueueConfig
from asyncrl.queue.entries import Delivery, EntryFields, Groups, RawFields, text
from asyncrl.queue.scripts import ADMIT_LUA
from asyncrl.queue.settle import Settler
from asyncrl.queue.stream import StreamClient, check_client

if TYPE_CHECKING:
    import redis

    from asyncrl.redis_conn import RedisGuard

log = logging.getLogger(__name__)

T = TypeVar("T")

_SCAN_PAGE = 500

# (entry id, fields or None when the entry was deleted while pending, times delivered)
_Raw = tuple[str, RawFields | None, int]


class Consumer(Generic[T]):
    """One named member of a consumer group. Not thread-safe: one reading thread per consumer.

    `is_alive(name)` says whether another consumer's heartbeat is current (see
    `asyncrl.heartbeat.is_alive`); consumer names are worker ids. `decode` turns fields into the
    value handed out; an exception it raises with a `reason` attribute, or any ValueError,
    dead-letters the entry instead of failing the read. `decode_batch` instead turns a read's
    entries at once into a value or such an exception each (a decoder whose fixed costs are
    paid once per read: `asyncrl.protocol.decode_groups`). With `groups`, entries are checked
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
        decode_batch: Callable[[list[RawFields]], Sequence[T | Exception]] | None = None,
        groups: Groups[T] | None = None,
        guard: RedisGuard | None = None,
    ) -> None:
        """`guard`: the role's Redis retry policy; without one, a guard of its own."""
        self._io = StreamClient.open(client, stream, cfg, guard)
        self.stream = stream
        self.group = group
        self.name = name
        self._groups = groups
        self._is_alive = is_alive
        if decode is not None and decode_batch is not None:
            raise ValueError("give decode or decode_batch, not both")
        self._decode = decode_batch or (None if decode is None else _one_by_one(decode))
        self._admit_script = client.register_script(ADMIT_LUA)
        self._settler = Settler(
            self._io,
            group,
            name,
            dlq=dlq,
            counters_key=counters_key,
            groups=groups,
            on_gone=self._group_gone,
        )
        self._held = self._settler.held
        self._group_ready = False
        # Cursor over our own pending entries; None once they have all been handed out.
        self._own_from: str | None = "-"
        now = time.monotonic()
        self._next_claim = now
        self._next_trim = now + self._io.cfg.trim_every_s

    @property
    def outages(self) -> int:
        """Redis outages this consumer's guard has waited through."""
        return self._io.guard.outages

    def read(self, count: int = 1, block_ms: int = 1000) -> list[Delivery[T]]:
        """Up to `count` entries: own pending ones first, then dead consumers' (every
        `claim_every_s`), then new ones, waiting up to `block_ms` for those. Dead-lettered entries
        are not returned. Blocks while Redis is unreachable."""
        check_client(self._io.client, block_ms)
        try:
            return self._io.guard.call(
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
        return self._settler.ack(ids, counters, also_add)

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
        return self._settler.settle(ids, outcome, check)

    def drop(self, entry_id: str, outcome: str, *, value: T | None = None) -> bool:
        """Ack an entry whose work is given up for a known cause, not failed (no dead letter):
        its group ends and counts `outcome` (a run counter) where it was still open, in one
        transaction that runs only while the entry is pending for this consumer. True when
        applied. Waits out outages; a full Redis does not hold it back (an ack frees memory)."""
        return self._settler.drop(entry_id, outcome, value)

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
        self._settler.dead_letter(entry_id, fields, reason, detail, value)

    def held_groups(self) -> dict[str, str]:
        """Entry id → group of the entries handed out and not yet acked (a claiming consumer's;
        any thread may ask)."""
        return self._held.groups.copy()

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
        self._held.ids.clear()
        self._own_from = "-"

    def _after_failure(self, outage: bool) -> None:
        # Entries read by the failed attempt (a reply lost in transit, or dropped because a
        # dead-letter write failed) sit in our pending list without having been handed out.
        self._own_from = "-"
        if outage:
            # Peers' heartbeats may have lapsed while Redis was down although they are alive:
            # give them time to beat again before judging them dead.
            self._next_claim = max(self._next_claim, time.monotonic() + self._io.cfg.claim_idle_s)

    def _read_once(self, count: int, block_ms: int) -> list[Delivery[T]]:
        from redis import exceptions as rx

        try:
            if not self._group_ready:
                self._create_group()
            now = time.monotonic()
            if now >= self._next_trim:
                trim_acked(self._io.client, self.stream)
                self._next_trim = now + self._io.cfg.trim_every_s
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
            self._io.client.xgroup_create(self.stream, self.group, id="0", mkstream=True)
        except rx.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise
        self._group_ready = True

    def _own_pending(self, count: int) -> list[_Raw]:
        while self._own_from is not None:
            page = _pending(
                self._io.client, self.stream, self.group, self._own_from, count, consumer=self.name
            )
            self._own_from = "(" + page[-1][0] if len(page) == count else None
            mine = {i: n for i, _, n in page if i not in self._held.ids}
            if mine:
                # Claiming our own entries re-reads them and counts the delivery, so a consumer
                # that crashes on an entry at every restart ends up dead-lettering it.
                return self._claim(mine, 0)
        return []

    def _claim_dead(self, count: int) -> list[_Raw]:
        idle_ms = int(self._io.cfg.claim_idle_s * 1000)
        found: dict[str, int] = {}
        owners: dict[str, int] = {}
        start = "-"
        while len(found) < count:
            page = _pending(
                self._io.client, self.stream, self.group, start, _SCAN_PAGE, idle_ms=idle_ms
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
        self._next_claim = now if len(found) == count else now + self._io.cfg.claim_every_s
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
            self._io.client.xclaim(self.stream, self.group, self.name, min_idle_ms, list(ids)),
        )
        if len(reply) == len(ids):
            # Every id was claimed, so replies line up with ids; a nil is an entry deleted while
            # pending (Redis 6.2 keeps those in the pending list).
            return [(i, f or None, prev[i] + 1) for i, (_, f) in zip(ids, reply, strict=True)]
        return [(text(i), f, prev[text(i)] + 1) for i, f in reply if i is not None and f]

    def _read_new(self, count: int, block_ms: int) -> list[_Raw]:
        reply = cast(
            list[tuple[bytes, list[tuple[bytes, RawFields]]]],
            self._io.client.xreadgroup(
                self.group, self.name, {self.stream: ">"}, count=count, block=block_ms or None
            ),
        )
        if not reply:
            return []
        return [(text(i), fields, 1) for i, fields in reply[0][1]]

    def _deliver(self, raw: list[_Raw]) -> list[Delivery[T]]:
        kept: list[tuple[str, RawFields, int]] = []
        for entry_id, fields, deliveries in raw:
            if deliveries > self._io.cfg.max_deliveries:
                self.dead_letter(entry_id, fields, "max_deliveries", f"delivered {deliveries}×")
            elif fields is None:
                self.dead_letter(entry_id, None, "deleted", "entry deleted while pending")
            else:
                kept.append((entry_id, fields, deliveries))
        values: Sequence[Any] = [f for _, f, _ in kept]
        if self._decode is not None and kept:
            values = self._decode(list(values))
        out: list[Delivery[T]] = []
        for (entry_id, fields, deliveries), value in zip(kept, values, strict=True):
            if isinstance(value, Exception) and self._decode is not None:
                reason = getattr(value, "reason", None)
                if reason is None and not isinstance(value, ValueError):
                    raise value
                self.dead_letter(entry_id, fields, str(reason or "decode_error"), str(value))
                continue
            out.append(Delivery(entry_id, fields, value, deliveries))
        if self._groups is not None and out:
            out = self._admit(out, self._groups)
        self._held.ids.update(d.id for d in out)
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
            verdict = "unreleased" if group is None else text(next(verdicts))
            if not verdict:
                if groups.claims and group is not None:
                    self._held.groups[d.id] = group
                out.append(d)
                continue
            detail = {
                "unreleased": f"group {group!r} is not in flight: never released, or it ended",
                "duplicate": f"group {group!r} is claimed by another entry",
            }[verdict]
            self.dead_letter(d.id, d.fields, verdict, detail, value=d.value)
        return out


def _one_by_one(decode: Callable[[RawFields], T]) -> Callable[[list[RawFields]], list[Any]]:
    """A per-entry decoder as a batch one: each entry's value, or the exception it raised."""

    def decode_each(batch: list[RawFields]) -> list[Any]:
        out: list[Any] = []
        for fields in batch:
            try:
                out.append(decode(fields))
            except Exception as exc:  # judged by the caller, as if raised there
                out.append(exc)
        return out

    return decode_each


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
    return [(text(p["message_id"]), text(p["consumer"]), int(p["times_delivered"])) for p in page]


def _id_key(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


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
            need = _id_key(text(oldest))
        else:
            ms, seq = _id_key(text(g["last-delivered-id"]))
            need = (ms, seq + 1)
        floor = need if floor is None else min(floor, need)
    if floor is None:
        return 0
    # Exact rather than `~`: XLEN stays true for `asyncrl status`, and a trim every few seconds
    # costs next to nothing either way.
    return int(client.xtrim(stream, minid=f"{floor[0]}-{floor[1]}", approximate=False))
