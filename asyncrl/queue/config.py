"""The queue's settings (`queue.*` in the config)."""

from __future__ import annotations

from pydantic import Field

from asyncrl.configbase import Section


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
