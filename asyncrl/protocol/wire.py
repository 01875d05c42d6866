"""Encoding and decoding: the records as msgpack maps and back. Decoding validates (`validate`):
a decoded object has always passed.

A trajectory group travels in one of two layouts, told apart by `schema`. Schema 1 holds a map
per sample; schema 2, the bulk layout written now, holds each array once for the whole group
(the samples' arrays end to end, `lengths` saying where each ends) and the per-sample scalars
as arrays, so neither writing, reading nor checking a group costs Python work per token array:

    schema: 2, run, group_id, prompt_id, release_version, worker, created_at, finished_at,
    prompt_ids: bin[int32]
    lengths: bin[int32] (response tokens of each sample)
    response_ids: bin[int32], logprobs: bin[float32], versions: bin[int32] (all samples' tokens)
    rewards: bin[float64], finish: bin[uint8] (0 stop, 1 length, 2 abort), meta: [map, ...]
    optional: has: bin[uint8] (per sample, bit 1 loss_mask, 2 audit_logprobs, 4 routed_experts),
      loss_mask: bin[uint8], audit_logprobs: bin[float32] (the tokens of the samples that have
      them), routed_experts: bin[uint16] (their fed tokens' rows), routed_shape: [layers, k]
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from dataclasses import fields, replace
from itertools import accumulate
from typing import Any

import msgpack
import numpy as np

from asyncrl.protocol.records import (
    DEFAULT_LIMITS,
    FINISH_CODES,
    PROMPT_SCHEMA,
    SCHEMA_VERSIONS,
    Limits,
    PromptGroup,
    Reason,
    Sample,
    TrajectoryGroup,
    ValidationError,
)
from asyncrl.protocol.validate import (
    Columns,
    check_bulk_samples,
    check_header,
    check_routing,
    check_tokens,
    validate_group,
    validate_prompt,
)

_I32 = np.dtype("<i4")
_F32 = np.dtype("<f4")
_F64 = np.dtype("<f8")
_U8 = np.dtype("u1")
_U16 = np.dtype("<u2")

# Upper bound on map sizes apart from meta: a group or sample map has about ten keys; the slack
# leaves room for optional keys added later within schema 1.
_MAX_STRUCT_KEYS = 32


def _bin(array: Any, dtype: np.dtype) -> memoryview:
    # A memoryview lets msgpack copy the array straight into its buffer; casting here is also
    # where big-endian hosts convert to little-endian.
    return np.ascontiguousarray(array, dtype=dtype).data


def _encode_sample(s: Sample) -> dict[str, Any]:
    out: dict[str, Any] = {
        "response_ids": _bin(s.response_ids, _I32),
        "logprobs": _bin(s.logprobs, _F32),
        "versions": _bin(s.versions, _I32),
        "reward": float(s.reward),
        "finish": s.finish,
        "meta": s.meta,
    }
    if s.loss_mask is not None:
        out["loss_mask"] = _bin(s.loss_mask, _U8)
    if s.audit_logprobs is not None:
        out["audit_logprobs"] = _bin(s.audit_logprobs, _F32)
    if s.routed_experts is not None:
        out["routed_experts"] = _bin(s.routed_experts, _U16)
        out["routed_shape"] = [int(d) for d in s.routed_experts.shape[1:]]
    return out


def _pack(
    message: TrajectoryGroup | PromptGroup,
    casts: dict[str, Callable[[Any], Any]],
    extra: dict[str, Any] | None = None,
) -> bytes:
    """A message as its wire map: `schema` first (readers check it before anything else), then
    the fields in the order the dataclass declares them — that order is the wire's, and
    `asyncrl.provenance` finds `group_id` near the top — each through its cast if it has one,
    then `extra` wire-only fields."""
    return msgpack.packb(
        {
            **{n: casts.get(n, _same)(getattr(message, n)) for n in _WIRE_NAMES[type(message)]},
            **(extra or {}),
        }
    )


# Once per type: dataclasses.fields costs about 3 µs a call, a tenth of encoding a short group.
_WIRE_NAMES = {
    cls: ("schema", *(f.name for f in fields(cls) if f.name != "schema"))
    for cls in (TrajectoryGroup, PromptGroup)
}


def _same(value: Any) -> Any:
    return value


def _i32(array: Any) -> memoryview:
    return _bin(array, _I32)


# The wire types of the fields that need a cast: numpy scalars and arrays do not pack as they are.
_GROUP_CASTS: dict[str, Callable[[Any], Any]] = {
    "release_version": int,
    "created_at": float,
    "finished_at": float,
    "prompt_ids": _i32,
    "samples": lambda samples: [_encode_sample(s) for s in samples],
}
_PROMPT_CASTS: dict[str, Callable[[Any], Any]] = {
    "prompt_ids": _i32,
    "n": int,
    "release_version": int,
}


def encode_group(g: TrajectoryGroup) -> bytes:
    """Pack a group in the layout of its `schema` (1: a map per sample, else the bulk layout),
    casting arrays to their wire dtypes. Does not validate: see validate_group."""
    return _encode(g)[0]


def _encode(g: TrajectoryGroup) -> tuple[bytes, int]:
    """The packed group and its `min_version`."""
    if g.schema == 1:
        return _pack(g, _GROUP_CASTS), g.min_version
    head, bins = _encode_bulk(g.samples)
    # Versions never decrease within a sample, so the oldest is the least first one; a group
    # that breaks this is refused by its reader whatever the field says. One index a sample,
    # where a reduction over each sample's versions cost a fifth of encoding a short group.
    firsts = [s.versions[0] for s in g.samples if len(s.versions)]
    low = int(min(firsts)) if firsts else g.release_version
    # The group's fields as `_pack` orders and casts them, written out: the generic loop over
    # them cost 3 µs of a short group's 20 (test_protocol checks the two agree).
    packed = msgpack.packb(
        {
            "schema": g.schema,
            "run": g.run,
            "group_id": g.group_id,
            "prompt_id": g.prompt_id,
            "release_version": int(g.release_version),
            "worker": g.worker,
            "created_at": float(g.created_at),
            "finished_at": float(g.finished_at),
            "prompt_ids": _i32(g.prompt_ids),
            **head,
        }
    )
    return _with_bins(packed, bins), low


# Flags of the bulk layout's `has`: which optional arrays a sample carries.
_HAS_MASK, _HAS_AUDIT, _HAS_ROUTED = 1, 2, 4
_FINISH_CODE = {name: code for code, name in enumerate(FINISH_CODES)}

# A field of the bulk layout whose bin is the samples' arrays end to end, and their wire dtype.
_Bin = tuple[str, list[Any], np.dtype]


def _encode_bulk(samples: list[Sample]) -> tuple[dict[str, Any], list[_Bin]]:
    """The bulk layout's sample fields: the short ones packed as usual, and the per-token ones,
    each the samples' arrays end to end (`_with_bins`)."""
    n = len(samples)
    # struct packs a few scalars faster than numpy builds an array of them; "<" is the wire's
    # byte order on any host.
    head: dict[str, Any] = {
        "lengths": struct.pack(f"<{n}i", *[len(s.response_ids) for s in samples]),
        "rewards": struct.pack(f"<{n}d", *[s.reward for s in samples]),
        # An unknown finish goes as a code no reader knows, to be refused there.
        "finish": bytes([_FINISH_CODE.get(s.finish, 255) for s in samples]),
        "meta": [s.meta for s in samples],
    }
    bins: list[_Bin] = [
        ("response_ids", [s.response_ids for s in samples], _I32),
        ("logprobs", [s.logprobs for s in samples], _F32),
        ("versions", [s.versions for s in samples], _I32),
    ]
    masks = [s.loss_mask for s in samples if s.loss_mask is not None]
    audits = [s.audit_logprobs for s in samples if s.audit_logprobs is not None]
    routed = [s.routed_experts for s in samples if s.routed_experts is not None]
    if not (masks or audits or routed):
        return head, bins
    head["has"] = bytes(
        [
            _HAS_MASK * (s.loss_mask is not None)
            + _HAS_AUDIT * (s.audit_logprobs is not None)
            + _HAS_ROUTED * (s.routed_experts is not None)
            for s in samples
        ]
    )
    if masks:
        bins.append(("loss_mask", masks, _U8))
    if audits:
        bins.append(("audit_logprobs", audits, _F32))
    if routed:
        # Samples whose rows differ in layers × top-k cannot share one array: the reader
        # refuses the group, as it would refuse them in schema 1.
        shapes = {r.shape[1:] for r in routed}
        shape = shapes.pop() if len(shapes) == 1 else (0, 0)
        bins.append(("routed_experts", routed, _U16))
        head["routed_shape"] = [int(d) for d in shape]
    return head, bins


def _with_bins(packed: bytes, bins: list[_Bin], contiguous: bool = False) -> bytes:
    """`packed`, a msgpack map, with the `bins` fields added: each written from the samples'
    own arrays into the message, so the tokens are copied once (joining them first, then
    packing the joined array, copied them twice). `contiguous`: copy each array that is not
    C-contiguous first (bytes.join refuses those)."""
    first = packed[0]
    if first >> 4 == 0x8:  # fixmap
        count, at = first & 0x0F, 1
    else:  # map16: a map of this many keys is never a map32
        count, at = int.from_bytes(packed[1:3], "big"), 3
    count += len(bins)
    parts: list[Any] = [
        bytes([0x80 | count]) if count < 16 else b"\xde" + count.to_bytes(2, "big"),
        memoryview(packed)[at:],
    ]
    for key, arrays, dtype in bins:
        # `is`: numpy's dtypes of a kind are one object; a slower check cost more than a copy.
        sizes = [a.nbytes for a in arrays if type(a) is np.ndarray and a.dtype is dtype]
        if len(sizes) < len(arrays):  # lists, other dtypes: cast as the wire needs
            arrays = [np.concatenate(arrays, dtype=dtype, casting="unsafe")]
            sizes = [arrays[0].nbytes]
        elif contiguous:
            arrays = [np.ascontiguousarray(a) for a in arrays]
        size = sum(sizes)
        if size < 2**8:
            header = b"\xc4" + size.to_bytes(1, "big")
        elif size < 2**16:
            header = b"\xc5" + size.to_bytes(2, "big")
        else:
            header = b"\xc6" + size.to_bytes(4, "big")
        parts += [_KEYS[key], header, *arrays]
    try:
        return b"".join(parts)
    except BufferError:  # an array that is not C-contiguous
        return _with_bins(packed, bins, contiguous=True)


_KEYS = {
    key: msgpack.packb(key)
    for key in (
        "response_ids",
        "logprobs",
        "versions",
        "loss_mask",
        "audit_logprobs",
        "routed_experts",
    )
}


def stream_fields(g: TrajectoryGroup) -> dict[bytes | str, bytes]:
    """Fields of the `trajectories` stream entry: the message in `data`, plus `schema` and
    `min_version` as ASCII so a reader can route or drop stale groups without decoding."""
    data, min_version = _encode(g)
    return {"data": data, "schema": str(g.schema).encode(), "min_version": b"%d" % min_version}


def plain_value_problem(value: Any) -> str | None:
    """Why `value` cannot be an answer on the wire, or None: it must come back from JSON as
    it went in (no tuples, non-string keys, NaN, or objects)."""
    try:
        text = json.dumps(value, allow_nan=False)
    except (TypeError, ValueError) as exc:
        return f"{type(value).__name__} is not plain data ({exc})"
    if json.loads(text) != value:
        return f"{type(value).__name__} does not survive JSON unchanged"
    return None


def encode_prompt(p: PromptGroup) -> bytes:
    """Pack a prompt group (the `data` field of a `prompts` entry). Does not validate."""
    if isinstance(p.answer, str):
        return _pack(p, _PROMPT_CASTS)
    # Any other plain answer goes as JSON text beside an empty `answer`, which stays a string.
    answer_json = json.dumps(p.answer, allow_nan=False)
    return _pack(replace(p, answer=""), _PROMPT_CASTS, {"answer_json": answer_json})


def _reject_ext(code: int, data: bytes) -> Any:
    raise ValidationError("malformed", f"msgpack ext type {code} is not allowed")


def unpack(
    data: bytes | bytearray | memoryview, limits: Limits, schemas: frozenset[int]
) -> dict[str, Any]:
    """Unpack a top-level map whose `schema` is one of `schemas`, rejecting oversize input before
    unpacking."""
    try:
        size = memoryview(data).nbytes
    except TypeError:
        raise ValidationError("malformed", f"expected bytes, got {type(data).__name__}") from None
    if size > limits.max_message_bytes:
        raise ValidationError(
            "too_large", f"message of {size} bytes exceeds {limits.max_message_bytes}"
        )
    max_tokens = max(limits.max_response_tokens, limits.max_prompt_tokens)
    try:
        # Length caps bound every allocation by the limits rather than by the claimed lengths.
        # Nesting is bounded by msgpack itself: StackError beyond depth 1024 in the C unpacker, or
        # on RecursionError in the pure-Python fallback; caught below like any other failure.
        obj = msgpack.unpackb(
            data,
            raw=False,
            strict_map_key=True,
            ext_hook=_reject_ext,
            # Routed experts take layers × top-k × 2 bytes a token: bounded by the message size.
            max_bin_len=max(4 * max_tokens, limits.max_message_bytes),
            max_str_len=limits.max_message_bytes,
            max_array_len=limits.max_samples,
            max_map_len=max(limits.max_meta_keys, _MAX_STRUCT_KEYS),
        )
    except ValidationError:
        raise
    except Exception as e:  # any failure inside msgpack means the bytes are unusable
        # msgpack names a broken length cap only in its message ("N exceeds max_bin_len(M)").
        reason: Reason = "too_large" if "exceeds max_" in str(e) else "malformed"
        raise ValidationError(reason, f"cannot unpack: {type(e).__name__}: {e}") from e
    if type(obj) is not dict:
        raise ValidationError("malformed", f"top level is {type(obj).__name__}, expected a map")
    schema = obj.get("schema")
    if type(schema) is not int or schema not in schemas:
        raise ValidationError("schema", f"unknown schema {schema!r}, expected {max(schemas)}")
    return obj


_MISSING = object()


def _take(d: dict[str, Any], key: str, types: tuple[type, ...], where: str) -> Any:
    # Exact type match: msgpack yields exact types, and bool must not pass as int.
    value = d.get(key, _MISSING)
    if type(value) not in types:
        got = "missing" if value is _MISSING else type(value).__name__
        want = "/".join(t.__name__ for t in types)
        raise ValidationError("malformed", f"{where}{key}: expected {want}, got {got}")
    return value


def _float(d: dict[str, Any], key: str, where: str) -> float:
    # Other encoders may write a whole number as a msgpack int.
    return float(_take(d, key, (float, int), where))


def _array(d: dict[str, Any], key: str, dtype: np.dtype, where: str) -> np.ndarray:
    raw = _take(d, key, (bytes,), where)
    if len(raw) % dtype.itemsize:
        raise ValidationError(
            "malformed", f"{where}{key}: {len(raw)} bytes is not a multiple of {dtype.itemsize}"
        )
    return np.frombuffer(raw, dtype)  # positional: a keyword costs 0.2 µs, an array


def _answer(d: dict[str, Any]) -> Any:
    answer = _take(d, "answer", (str,), "")
    if "answer_json" not in d:
        return answer
    try:  # JSON, never pickle: the text is data only
        return json.loads(_take(d, "answer_json", (str,), ""))
    except (ValueError, RecursionError) as exc:
        raise ValidationError("malformed", f"answer_json: {type(exc).__name__}: {exc}") from None


def _decode_sample(d: Any, where: str) -> Sample:
    if type(d) is not dict:
        raise ValidationError(
            "malformed", f"{where.rstrip('.')}: expected a map, got {type(d).__name__}"
        )
    loss_mask = _array(d, "loss_mask", _U8, where) if "loss_mask" in d else None
    return Sample(
        response_ids=_array(d, "response_ids", _I32, where),
        logprobs=_array(d, "logprobs", _F32, where),
        versions=_array(d, "versions", _I32, where),
        reward=_float(d, "reward", where),
        finish=_take(d, "finish", (str,), where),
        meta=_take(d, "meta", (dict,), where) if "meta" in d else {},
        loss_mask=loss_mask,
        audit_logprobs=(
            _array(d, "audit_logprobs", _F32, where) if "audit_logprobs" in d else None
        ),
        routed_experts=_routed(d, where) if "routed_experts" in d else None,
    )


def _routed(d: dict[str, Any], where: str) -> np.ndarray:
    """The routed experts as [tokens, layers, top-k]; the token count is checked later."""
    ids = _array(d, "routed_experts", _U16, where)
    shape = _take(d, "routed_shape", (list,), where)
    if len(shape) != 2 or any(type(n) is not int or n < 1 for n in shape):
        raise ValidationError("routing_shape", f"{where}routed_shape {shape!r} is not [layers, k]")
    layers, k = shape
    if len(ids) % (layers * k):
        raise ValidationError(
            "routing_shape", f"{where}routed_experts: {len(ids)} ids are not rows of {layers}x{k}"
        )
    return ids.reshape(-1, layers, k)


def decode_group(
    data: bytes | bytearray | memoryview,
    limits: Limits | None = None,
    *,
    current_version: int | None = None,
) -> TrajectoryGroup:
    """Unpack and fully validate a group of either layout (see `validate_group`;
    `current_version` is passed on).

    Raises `ValidationError`, and only that, for any input that is not a valid group.
    """
    limits = limits or DEFAULT_LIMITS
    d = unpack(data, limits, SCHEMA_VERSIONS)
    g = TrajectoryGroup(
        run=_take(d, "run", (str,), ""),
        group_id=_take(d, "group_id", (str,), ""),
        prompt_id=_take(d, "prompt_id", (str,), ""),
        release_version=_take(d, "release_version", (int,), ""),
        worker=_take(d, "worker", (str,), ""),
        created_at=_float(d, "created_at", ""),
        finished_at=_float(d, "finished_at", ""),
        prompt_ids=_array(d, "prompt_ids", _I32, ""),
        samples=[],
        schema=d["schema"],
    )
    if g.schema == 1:
        samples = _take(d, "samples", (list,), "")
        g.samples = [_decode_sample(s, f"samples[{i}].") for i, s in enumerate(samples)]
        validate_group(g, current_version=current_version, limits=limits)
    else:
        _decode_bulk(d, g, limits, current_version)
    return g


def _decode_bulk(
    d: dict[str, Any], g: TrajectoryGroup, limits: Limits, current_version: int | None
) -> None:
    """The samples of a bulk-layout group into `g.samples`, validated as `validate_group` would:
    the per-sample scalars as lists, the tokens as one run each (`check_tokens`)."""
    lengths_array = _array(d, "lengths", _I32, "")
    check_header(g, len(lengths_array), limits)
    lengths: list[int] = lengths_array.tolist()
    n = len(lengths)
    rewards_array = _array(d, "rewards", _F64, "")
    finish_bytes = _take(d, "finish", (bytes,), "")
    metas = _take(d, "meta", (list,), "") if "meta" in d else [{}] * n
    has_bytes = _take(d, "has", (bytes,), "") if "has" in d else bytes(n)
    # Counted before they become lists: a field as long as the message allows must cost nothing.
    counts = [len(rewards_array), len(finish_bytes), len(metas), len(has_bytes)]
    if counts != [n] * 4:
        raise ValidationError(
            "malformed",
            f"{n} lengths but {counts} rewards, finish, meta, has: one each per sample",
        )
    rewards, finish, has = rewards_array.tolist(), list(finish_bytes), list(has_bytes)
    check_bulk_samples(lengths, rewards, finish, metas, len(g.prompt_ids), limits)

    ends = list(accumulate(lengths))
    bounds = [(end - size, end) for end, size in zip(ends, lengths, strict=True)]
    ids = _joined_array(d, "response_ids", _I32, ends[-1])
    logprobs = _joined_array(d, "logprobs", _F32, ends[-1])
    versions = _joined_array(d, "versions", _I32, ends[-1])
    masks_of, masks = _optional(d, "loss_mask", _U8, has, _HAS_MASK, bounds)
    audits_of, audits = _optional(d, "audit_logprobs", _F32, has, _HAS_AUDIT, bounds)
    used = [i for i, size in enumerate(lengths) if size]
    if used:  # no tokens, nothing for the token rules
        check_tokens(
            Columns(
                lengths=lengths_array,
                ids=[ids],
                logprobs=[logprobs],
                versions=[versions],
                firsts=versions[[bounds[i][0] for i in used]],
                lasts=versions[[bounds[i][1] - 1 for i in used]],
                audit_logprobs=audits,
                loss_masks=masks,
                is_joined=True,
            ),
            limits,
            current_version,
        )
    routed_of = _bulk_routing(d, has, lengths, len(g.prompt_ids))
    g.samples = [
        Sample(ids[a:b], logprobs[a:b], versions[a:b], *more)
        for (a, b), *more in zip(
            bounds,
            rewards,
            [FINISH_CODES[code] for code in finish],
            metas,
            masks_of,
            audits_of,
            routed_of,
            strict=True,
        )
    ]
    check_routing(g, limits)


def _joined_array(d: dict[str, Any], key: str, dtype: np.dtype, total: int) -> np.ndarray:
    """A field of all samples' tokens end to end, which must hold `total`."""
    array = _array(d, key, dtype, "")
    if len(array) != total:
        raise ValidationError(
            "length_mismatch", f"{key}: {len(array)} values where the samples have {total} tokens"
        )
    return array


def _optional(
    d: dict[str, Any], key: str, dtype: np.dtype, has: list[int], flag: int, bounds: list[Any]
) -> tuple[list[np.ndarray | None], list[np.ndarray]]:
    """An optional per-token field of the bulk layout: each sample's piece (None where its `has`
    lacks `flag`), and the field as one run, or none where no sample has it."""
    if not any(has) or not any(h & flag for h in has):  # any(has): C speed, the common case
        return [None] * len(has), []
    sizes = [b - a if h & flag else None for h, (a, b) in zip(has, bounds, strict=True)]
    array = _array(d, key, dtype, "")
    return _cut(array, sizes, key), [array]


def _cut(
    array: np.ndarray, sizes: list[int | None], key: str, reason: Reason = "length_mismatch"
) -> list[np.ndarray | None]:
    """`array` (all samples' values of `key` end to end) in pieces: `sizes` rows from where the
    one before ended, or None where the size is None."""
    total = sum(size for size in sizes if size is not None)
    if len(array) != total:
        raise ValidationError(reason, f"{key}: {len(array)} rows where the samples have {total}")
    pieces: list[np.ndarray | None] = []
    at = 0
    for size in sizes:
        if size is None:
            pieces.append(None)
        else:
            pieces.append(array[at : at + size])
            at += size
    return pieces


def _bulk_routing(
    d: dict[str, Any], has: list[int], lengths: list[int], n_prompt: int
) -> list[np.ndarray | None]:
    """Each sample's routed experts, [fed tokens, layers, k], or None where it has none."""
    if not any(has):
        return [None] * len(has)
    fed = [
        n_prompt + size - 1 if h & _HAS_ROUTED else None
        for h, size in zip(has, lengths, strict=True)
    ]
    if all(rows is None for rows in fed):
        return fed  # type: ignore[return-value]  # all None
    if any(rows is not None and rows < 0 for rows in fed):
        raise ValidationError("routing_shape", "routed_experts of a sample with no fed token")
    return _cut(_routed(d, ""), fed, "routed_experts", "routing_shape")


def decode_prompt(
    data: bytes | bytearray | memoryview, limits: Limits | None = None
) -> PromptGroup:
    """Unpack and validate a prompt group; raises `ValidationError` and only that."""
    limits = limits or DEFAULT_LIMITS
    d = unpack(data, limits, frozenset({PROMPT_SCHEMA}))
    p = PromptGroup(
        run=_take(d, "run", (str,), ""),
        prompt_id=_take(d, "prompt_id", (str,), ""),
        prompt=_take(d, "prompt", (str,), ""),
        prompt_ids=_array(d, "prompt_ids", _I32, ""),
        answer=_answer(d),
        task=_take(d, "task", (str,), ""),
        n=_take(d, "n", (int,), ""),
        release_version=_take(d, "release_version", (int,), ""),
        meta=_take(d, "meta", (dict,), "") if "meta" in d else {},
        schema=d["schema"],
    )
    validate_prompt(p, limits=limits)
    return p
