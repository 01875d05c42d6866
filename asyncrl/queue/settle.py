"""How a consumer settles the entries it holds: `ack` (with what it adds and counts), `settle`
(entry by entry, with an outcome), `drop` (given up for a known cause) and dead letters — each
one server-side transaction that runs only while the consumer still owns the entry — and what a
dead letter keeps of its entry."""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar, cast

from asyncrl.queue.entries import EntryFields, Fields, Groups, RawFields, entry_size
from asyncrl.queue.scripts import SETTLE_LUA, transact
from asyncrl.queue.stream import StreamClient
from asyncrl.redis_conn import is_oom
from asyncrl.runstate import Counter

log = logging.getLogger(__name__)

T = TypeVar("T")

# What a dead letter that ends its group counts, and what one that ends none (junk, a duplicate).
_DEAD_LETTER_COUNTERS = (Counter.GROUPS_DEAD_LETTERED.value, Counter.ENTRIES_REJECTED.value)

_DLQ_META = (b"stream", b"id", b"reason", b"detail", b"orig_bytes", b"orig_sha256")
_DETAIL_MAX = 1000
# Fields a dead letter copies at most: the transaction script unpacks them onto Lua's stack.
_DLQ_MAX_FIELDS = 64
_GONE = -2  # `_transact` status: the consumer group (or the whole stream) no longer exists


@dataclass
class Held:
    """What a consumer has handed out and not settled: the ids (scans of its own pending entries
    skip them, so one process never hands an entry out twice) and, for a claiming consumer, the
    group of each, for its ack to end."""

    ids: set[str] = field(default_factory=set)
    groups: dict[str, str] = field(default_factory=dict)

    def settled(self, ids: Iterable[str]) -> None:
        for i in ids:
            self.ids.discard(i)
            self.groups.pop(i, None)


class Settler(Generic[T]):
    """The settling half of a `Consumer`: what it does with the entries it holds, each in one
    transaction. `on_gone` hears that the consumer group vanished with the entries it held."""

    def __init__(
        self,
        io: StreamClient,
        group: str,
        name: str,
        *,
        dlq: str,
        counters_key: str,
        groups: Groups[T] | None,
        on_gone: Callable[[], None],
    ) -> None:
        self._io = io
        self.group = group
        self.name = name
        self._dlq = dlq
        self._counters_key = counters_key
        self._groups = groups
        self._on_gone = on_gone
        self._settle_script = io.client.register_script(SETTLE_LUA)
        self.held = Held()

    def ack(
        self,
        ids: Iterable[str],
        counters: Mapping[str, int] | None,
        also_add: list[tuple[str, EntryFields]] | None,
    ) -> bool:
        """`Consumer.ack`."""
        ids = list(ids)
        adds = also_add or []
        size = sum(entry_size(fields, self._io.cfg.max_message_bytes) for _, fields in adds)
        outcome_unknown = False

        def on_retry(outage: bool) -> None:
            nonlocal outcome_unknown
            outcome_unknown |= outage

        def attempt() -> tuple[int, list[str]]:
            return self._transact(ids, counters or {}, adds, self._claimed_ends(ids))

        status, _ = self._io.guard.call(
            attempt,
            f"ack on {self._io.stream}",
            memory=self._io.memory if adds else None,
            on_retry=on_retry,
        )
        self.held.settled(ids)
        self._io.memory.added(size)
        if status == 1 or (status == 0 and outcome_unknown):
            return True
        if status == _GONE:
            return False  # `on_gone` said so
        log.warning(
            "%s: ack of %d entries on %s not applied: %s",
            self.name,
            len(ids),
            self._io.stream,
            "already acked" if status == 0 else "taken over by another consumer",
        )
        return False

    def settle(self, ids: Iterable[str], outcome: str, check: Callable[[], object] | None) -> int:
        """`Consumer.settle`."""
        ids = list(ids)
        if not ids:
            return 0

        def attempt() -> int:
            if check is not None:
                check()
            keys = [self._io.stream, self._counters_key, self._groups.key if self._groups else "-"]
            args: list[Any] = [self.group, self.name, outcome, len(ids), *ids]
            for group, entry_id in self._claimed_ends(ids):
                args += [group, entry_id]
            return int(cast(int, self._settle_script(keys=keys, args=args)))

        counted = self._io.guard.call(attempt, f"ack on {self._io.stream}")
        self.held.settled(ids)
        if counted < len(ids):
            log.warning(
                "%s: %d of %d entries on %s not acked: acked already, taken over, or lost with "
                "Redis's data before they were read",
                self.name,
                len(ids) - counted,
                len(ids),
                self._io.stream,
            )
        return counted

    def drop(self, entry_id: str, outcome: str, value: T | None) -> bool:
        """`Consumer.drop`."""
        ends: list[tuple[str, str]] = []
        if self._groups is not None:
            group = self.held.groups.get(entry_id) or self._groups.group_of(entry_id, None, value)
            ends = [] if group is None else [(group, entry_id)]
        status, _ = self._io.guard.call(
            lambda: self._transact([entry_id], {}, [], ends, (outcome, "")),
            f"drop on {self._io.stream}",
        )
        self.held.settled([entry_id])
        return status == 1

    def dead_letter(
        self, entry_id: str, fields: RawFields | None, reason: str, detail: str, value: T | None
    ) -> None:
        """`Consumer.dead_letter`."""
        entry: Fields = {
            b"stream": self._io.stream,
            b"id": entry_id,
            b"reason": reason,
            b"detail": detail[:_DETAIL_MAX],
        }
        if fields is not None:
            entry.update(dead_letter_summary(fields))
        payload = dead_letter_payload(fields or {}, self._io.cfg.dead_letter_payload_bytes)
        counters: dict[str, int] = {Counter.GROUPS_DEAD_LETTERED: 1}
        ends: list[tuple[str, str]] = []
        if self._groups is not None:
            group = self.held.groups.get(entry_id) or self._groups.group_of(entry_id, fields, value)
            counters, ends = (
                ({}, [(group, entry_id)])
                if group is not None
                else ({Counter.ENTRIES_REJECTED: 1}, [])
            )
        status, note = self._io.guard.call(
            lambda: self._dead_letter_once(entry_id, counters, ends, entry, payload),
            f"dead-letter on {self._io.stream}",
        )
        self.held.settled([entry_id])
        if status == 1:
            log.warning(
                "%s: dead-lettered %s of %s: %s (%s)%s",
                self.name,
                entry_id,
                self._io.stream,
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
        if not self._io.memory.full():
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
                self._io.client.xtrim(
                    self._dlq, maxlen=self._io.cfg.dead_letter_max_entries, approximate=False
                )
            return status, note
        # Not even that fits: a plain ack, whose XACK Redis never refuses, frees the entry.
        status, _ = self._transact([entry_id], counters, [], ends, _DEAD_LETTER_COUNTERS)
        return status, "; Redis is full: no dead letter written"

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
            return transact(
                self._io.script,
                stream=self._io.stream,
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
            self._on_gone()
            return _GONE, []

    def _claimed_ends(self, ids: list[str]) -> list[tuple[str, str]]:
        """(group, id) of the entries of a claiming consumer, for their ack to end. An entry
        this consumer did not hand out (one a restarted trainer acks for its checkpoint) is read
        back for its group."""
        if self._groups is None or not self._groups.claims:
            return []
        for i in ids:
            if i not in self.held.groups:
                rows = cast(
                    list[tuple[bytes, RawFields]], self._io.client.xrange(self._io.stream, i, i)
                )
                group = self._groups.group_of(i, rows[0][1] if rows else None, None)
                if group is not None:
                    self.held.groups[i] = group
        return [(self.held.groups[i], i) for i in ids if i in self.held.groups]


def dead_letter_payload(fields: RawFields, budget: int) -> Fields:
    """The fields of an entry as its dead letter keeps them: in order while names and values
    together fit `budget` bytes (and at most `_DLQ_MAX_FIELDS`); the value that crosses the bound
    keeps a prefix, later fields are left out. Fields named like dead-letter metadata are renamed
    `orig.NAME`."""
    kept: Fields = {}
    for k, v in fields.items():
        budget -= len(k)
        if budget < 0 or len(kept) == _DLQ_MAX_FIELDS:
            break
        kept[b"orig." + k if k in _DLQ_META else k] = v[:budget]
        budget -= min(len(v), budget)
    return kept


def dead_letter_summary(fields: RawFields) -> Fields:
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
