"""`Producer`: adds entries to a stream, counted where the caller says, paused while Redis is
full."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import cached_property
from typing import TYPE_CHECKING, Any, cast

from asyncrl.queue.config import QueueConfig
from asyncrl.queue.entries import EntryFields, entry_size, text
from asyncrl.queue.scripts import ADD_COUNTED_LUA, transact
from asyncrl.queue.stream import StreamClient
from asyncrl.redis_conn import RedisGuard, is_oom

if TYPE_CHECKING:
    import redis
    from redis.commands.core import Script


class Producer:
    """Adds entries to a stream. Never trims: unconsumed entries are the queue.

    `add` is at least once: if the connection drops after Redis ran the XADD but before the reply
    arrived, the retry adds a second entry. A duplicate is a separate entry with its own id, and
    the counters were incremented with it in the same transaction, so run accounting stays
    balanced.
    """

    def __init__(
        self,
        client: redis.Redis,
        stream: str,
        cfg: QueueConfig | None = None,
        *,
        guard: RedisGuard | None = None,
    ) -> None:
        """`guard`: the role's Redis retry policy; without one, a guard of its own."""
        self._io = StreamClient.open(client, stream, cfg, guard)
        self.stream = stream

    @property
    def outages(self) -> int:
        """Redis outages this producer's guard has waited through."""
        return self._io.guard.outages

    @cached_property
    def _counted_script(self) -> Script:
        return self._io.client.register_script(ADD_COUNTED_LUA)

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
        size = entry_size(fields, self._io.cfg.max_message_bytes)
        if counters and counters_key is None:
            raise ValueError("counters need a counters_key")
        entry: dict[Any, Any] = dict(fields)

        def once() -> str:
            if not counters:
                return text(cast(bytes, self._io.client.xadd(self.stream, entry)))
            _, added = transact(
                self._io.script,
                stream=self.stream,
                ids=[],
                counters_key=counters_key,
                counters=counters,
                adds=[(self.stream, fields)],
            )
            return added[0]

        entry_id = self._io.guard.call(once, f"add to {self.stream}", memory=self._io.memory)
        self._io.memory.added(size)
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

        size = sum(entry_size(fields, self._io.cfg.max_message_bytes) for fields in entries)
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
            if not outcome_unknown and self._io.memory.full():
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

        applied = self._io.guard.call(attempt, f"add to {self.stream}", on_retry=on_retry)
        if applied is None:
            return False
        self._io.memory.added(size)
        return applied == 1 or outcome_unknown
