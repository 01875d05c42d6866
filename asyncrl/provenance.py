"""Provenance: only groups of prompts the trainer released are trained, and each at most once.

The `released` hash (`Keys.released`) holds one field per prompt group in flight, named by the
prompt's entry id in the `prompts` stream, which is the `group_id` its trajectory group carries:

- admission opens the field ("") in the transaction that adds the prompt and counts it released;
- a rollout worker refuses a prompt whose field is missing (`unreleased`: junk on the stream)
  or claimed already (`duplicate`), and publishes a trajectory group for it without touching it;
- the trainer, on reading a trajectory entry, claims the field for that entry (its id becomes
  the value). An entry whose field is missing is refused as `unreleased` (never released, or
  already finished), one whose field another entry claimed as `duplicate`; the claiming entry
  itself is accepted again (a redelivery after a restart);
- the field goes in the transaction that ends the group: the trainer's ack (trained or dropped
  stale), or a dead letter of its prompt or of its claiming (or still unclaimed) trajectory.

So a dead letter frees admission budget (`groups_dead_lettered`) only where it ends a released
group; any other counts `entries_rejected`, and junk never buys extra releases. At any quiet
moment prompts_released = groups_trained + groups_dropped_stale + groups_dead_lettered +
groups_lost + HLEN(released). The bookkeeping is the queue's (`asyncrl.queue.Groups`); this
module says how each stream names its entries' groups.
"""

from __future__ import annotations

from typing import Any

import msgpack

from asyncrl.protocol import PromptGroup, TrajectoryGroup
from asyncrl.queue import Groups, RawFields
from asyncrl.runstate import Keys

# A trajectory entry that fails to decode is searched for its group id in its first bytes only:
# the id sits near the top of the map (after `schema` and `run` as asyncrl writes it), and a
# bounded prefix bounds the cost whatever the entry holds.
_GROUP_ID_PREFIX = 4096
_GROUP_ID_MAX = 128
_MAX_KEYS = 64


def _reject_ext(code: int, data: bytes) -> Any:
    raise ValueError(f"msgpack ext type {code}")


def group_id_of(fields: RawFields | None) -> str | None:
    """The `group_id` of a trajectory entry's message, read without decoding the message: the
    top-level map's keys are scanned in its first bytes, other values skipped unread. None when
    the entry has no message, the message is not a map or the id is not a short string there."""
    data = (fields or {}).get(b"data")
    if not isinstance(data, bytes):
        return None
    unpacker = msgpack.Unpacker(
        raw=False,
        ext_hook=_reject_ext,
        max_buffer_size=_GROUP_ID_PREFIX,
        max_str_len=_GROUP_ID_PREFIX,
        max_bin_len=_GROUP_ID_PREFIX,
        max_array_len=_MAX_KEYS,
        max_map_len=_MAX_KEYS,
    )
    unpacker.feed(data[:_GROUP_ID_PREFIX])
    try:
        for _ in range(min(unpacker.read_map_header(), _MAX_KEYS)):
            key = unpacker.unpack()
            if key == "group_id":
                value = unpacker.unpack()
                return value if type(value) is str and len(value) <= _GROUP_ID_MAX else None
            unpacker.skip()
    except Exception:  # truncated, not a map, a value beyond the prefix: no id to be found
        return None
    return None


def _prompt_group(entry_id: str, fields: RawFields | None, value: PromptGroup | None) -> str:
    return entry_id  # a prompt entry is its group


def _trajectory_group(
    entry_id: str, fields: RawFields | None, value: TrajectoryGroup | None
) -> str | None:
    return value.group_id if value is not None else group_id_of(fields)


def prompt_groups(keys: Keys) -> Groups[PromptGroup]:
    """A rollout worker's: prompts must be in flight; the group lives on in the trajectory."""
    return Groups(keys.released, _prompt_group, claims=False)


def trajectory_groups(keys: Keys) -> Groups[TrajectoryGroup]:
    """The trainer's: each trajectory entry claims its group; acks and dead letters end it."""
    return Groups(keys.released, _trajectory_group, claims=True)
