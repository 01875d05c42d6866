"""Decoding a read's worth of trajectory entries at once (`decode_groups`): what `decode_group`
does to each, with the checks that cost a numpy call or a Python pass each run once over all
of them. A short group pays those fixed costs, not its tokens: at 8 × 256 tokens they were most
of its decode.

The batch path is a fast path only. An entry it cannot take whole (schema 1, optional arrays,
a whole number where a float goes, anything unusual) and every entry of a batch whose joined
checks fail is decoded again on its own by `decode_group`, so each entry's result, or its
error and reason, is exactly `decode_group`'s.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate, chain
from typing import Any

import numpy as np

from asyncrl.protocol.records import (
    DEFAULT_LIMITS,
    FINISH_CODES,
    SCHEMA_VERSIONS,
    Limits,
    MetaValue,
    Sample,
    TrajectoryGroup,
    ValidationError,
)
from asyncrl.protocol.validate import (
    META_TYPES,
    Columns,
    check_tokens,
    ids_within,
)
from asyncrl.protocol.wire import decode_group, unpack

# The fields of a bulk entry without optional arrays, and their exact msgpack types: one tuple
# compare checks them all.
_KEYS = (
    "schema",
    "run",
    "group_id",
    "prompt_id",
    "release_version",
    "worker",
    "created_at",
    "finished_at",
    "prompt_ids",
    "lengths",
    "response_ids",
    "logprobs",
    "versions",
    "rewards",
    "finish",
    "meta",
)
_TYPES = (int, str, str, str, int, str, float, float, *[bytes] * 7, list)
_I32 = np.dtype("<i4")
_F32 = np.dtype("<f4")
_F64 = np.dtype("<f8")


@dataclass(slots=True, eq=False)
class _Entry:
    """A bulk entry that passed its own checks; the joined ones pending."""

    group: TrajectoryGroup
    lengths: list[int]
    ids: bytes
    logprobs: bytes
    versions: bytes
    rewards: bytes
    finish: bytes
    metas: list[dict[str, MetaValue]]


def decode_groups(
    datas: Sequence[bytes | bytearray | memoryview],
    limits: Limits | None = None,
    *,
    current_version: int | None = None,
) -> list[TrajectoryGroup | ValidationError]:
    """Each of `datas` as `decode_group(data, limits, current_version=...)` returns it, or the
    `ValidationError` it raises; in order."""
    limits = limits or DEFAULT_LIMITS
    fast = [_parse(data, limits) for data in datas]
    for run in _runs([e for e in fast if e is not None]):
        if not _joined_ok(run, limits, current_version):
            fast = [None if e in run else e for e in fast]
    out: list[TrajectoryGroup | ValidationError] = []
    for data, entry in zip(datas, fast, strict=True):
        if entry is not None:
            out.append(_built(entry))
            continue
        try:
            out.append(decode_group(data, limits, current_version=current_version))
        except ValidationError as exc:
            out.append(exc)
    return out


# Tokens of a run of entries checked together. Each joined array (4 bytes a token) stays below
# the 128 KiB from which the trainer's malloc maps fresh pages (`device.return_freed_memory`).
# 16 entries of 8 × 256 tokens, µs a group in runs of 2,048 / 8,192 / 16,384 / 32,768 tokens:
# 61 / 37 / 33 / 40, and with the trainer's malloc setting 65 / 45 / 40 / 43.
_RUN_TOKENS = 16384


def _runs(entries: list[_Entry]) -> list[list[_Entry]]:
    """`entries` in runs of consecutive ones checked together: up to `_RUN_TOKENS` tokens, or
    one entry (whose arrays need no copy). Joining copies the tokens: it pays where the fixed
    cost of a numpy call is most of a check (8 × 256 tokens a group: 19 → 3 µs a group for the
    token rules, with the copy), not for long groups (16 × 1,024: slower joined)."""
    runs: list[list[_Entry]] = []
    tokens = _RUN_TOKENS
    for e in entries:
        size = len(e.ids) // 4
        if tokens + size > _RUN_TOKENS:
            runs.append([])
            tokens = 0
        runs[-1].append(e)
        tokens += size
    return runs


def _parse(data: bytes | bytearray | memoryview, limits: Limits) -> _Entry | None:
    """The entry's own checks of `decode_group` on a bulk entry of the common shape; None where
    it is not one or fails one (the exact path then says why)."""
    try:
        d = unpack(data, limits, SCHEMA_VERSIONS)
    except ValidationError:
        return None
    values: tuple[Any, ...] = tuple(map(d.get, _KEYS))
    if tuple(map(type, values)) != _TYPES or values[0] != 2 or "has" in d:
        return None
    (_, run, group_id, prompt_id, release, worker, created, finished) = values[:8]
    prompt, lengths_raw, ids, logprobs, versions, rewards, finish, metas = values[8:]
    n = len(finish)
    n_prompt = len(prompt) // 4
    if (
        not 0 < n <= limits.max_samples
        or len(lengths_raw) != 4 * n
        or len(rewards) != 8 * n
        or len(metas) != n
        or len(prompt) % 4
        or n_prompt > limits.max_prompt_tokens
        or release < 0
    ):
        return None
    lengths: list[int] = np.frombuffer(lengths_raw, _I32).tolist()
    longest, total = max(lengths), sum(lengths)
    if (
        min(lengths) < 0
        or longest > limits.max_response_tokens
        or (limits.max_positions is not None and n_prompt + longest > limits.max_positions)
        or not len(ids) == len(logprobs) == len(versions) == 4 * total
    ):
        return None
    group = TrajectoryGroup(
        run,
        group_id,
        prompt_id,
        release,
        worker,
        created,
        finished,
        np.frombuffer(prompt, _I32),
        [],
        2,
    )
    return _Entry(group, lengths, ids, logprobs, versions, rewards, finish, metas)


def _joined_ok(entries: list[_Entry], limits: Limits, current_version: int | None) -> bool:
    """Whether the checks over the samples of all `entries` pass: one call each over them all."""
    rewards = np.frombuffer(b"".join(e.rewards for e in entries), _F64)
    if not np.isfinite(rewards).all() or max(b"".join(e.finish for e in entries)) >= len(
        FINISH_CODES
    ):
        return False
    if not _metas_ok(list(chain.from_iterable(e.metas for e in entries)), limits):
        return False
    prompts = np.concatenate([e.group.prompt_ids for e in entries])
    if len(prompts) and not ids_within(prompts, limits.vocab_size):
        return False
    lengths = np.array(list(chain.from_iterable(e.lengths for e in entries)))
    if not lengths.any():
        return True
    versions = np.frombuffer(b"".join(e.versions for e in entries), _I32)
    ends = np.cumsum(lengths)
    used = lengths > 0
    columns = Columns(
        lengths=lengths,
        ids=[np.frombuffer(b"".join(e.ids for e in entries), _I32)],
        logprobs=[np.frombuffer(b"".join(e.logprobs for e in entries), _F32)],
        versions=[versions],
        firsts=versions[(ends - lengths)[used]],
        lasts=versions[ends[used] - 1],
        audit_logprobs=[],
        loss_masks=[],
        is_joined=True,
    )
    try:
        check_tokens(columns, limits, current_version)
    except ValidationError:
        return False
    return True


def _metas_ok(metas: list[dict[str, MetaValue]], limits: Limits) -> bool:
    """`check_meta`'s rules over many maps in a few passes. The size bound is checked on their
    sum, which bounds each map's: a run whose maps sum past `max_meta_bytes` (16 KiB by default,
    about 250 bytes a sample in a run of 64 samples) takes the exact path, at its own cost."""
    if set(map(type, metas)) != {dict} or max(map(len, metas)) > limits.max_meta_keys:
        return False
    keys = list(chain.from_iterable(metas))
    values = list(chain.from_iterable(map(dict.values, metas)))
    if not set(map(type, keys)) <= {str} or not set(map(type, values)) <= META_TYPES:
        return False
    strings = sum(len(v) - 8 for v in values if type(v) is str)
    return sum(map(len, keys)) + 8 * len(values) + strings <= limits.max_meta_bytes


def _built(e: _Entry) -> TrajectoryGroup:
    """The entry's group with its samples: views of its arrays, as `decode_group` makes them."""
    ids = np.frombuffer(e.ids, _I32)
    logprobs = np.frombuffer(e.logprobs, _F32)
    versions = np.frombuffer(e.versions, _I32)
    ends = list(accumulate(e.lengths))
    e.group.samples = [
        Sample(ids[b - n : b], logprobs[b - n : b], versions[b - n : b], r, FINISH_CODES[f], m)
        for b, n, r, f, m in zip(
            ends, e.lengths, np.frombuffer(e.rewards, _F64).tolist(), e.finish, e.metas, strict=True
        )
    ]
    return e.group
