"""What a stream entry is to the queue: its fields as added and as read, the `Groups` it may
belong to, and the `Delivery` a consumer hands out."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")

# What XADD accepts as an entry; what comes back from a client without decode_responses is
# dict[bytes, bytes].
EntryFields = Mapping[str | bytes, bytes | str | int | float]
RawFields = dict[bytes, bytes]
Fields = dict[str | bytes, bytes | str | int | float]  # an entry being built


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


def entry_size(fields: EntryFields, limit: int) -> int:
    """The size a stream entry counts for (its field values); ValueError above `limit`."""
    size = sum(len(v) if isinstance(v, bytes | str) else 8 for v in fields.values())
    if size > limit:
        raise ValueError(f"stream entry of {size} bytes exceeds queue.max_message_bytes={limit}")
    return size


def text(x: bytes | str) -> str:
    return x.decode() if isinstance(x, bytes) else x
