"""Encoding and decoding: the records as msgpack maps and back. Decoding validates (`validate`):
a decoded object has always passed."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import fields, replace
from typing import Any

import msgpack
import numpy as np

from asyncrl.protocol.records import (
    DEFAULT_LIMITS,
    SCHEMA_VERSION,
    Limits,
    PromptGroup,
    Reason,
    Sample,
    TrajectoryGroup,
    ValidationError,
)
from asyncrl.protocol.validate import validate_group, validate_prompt

_I32 = np.dtype("<i4")
_F32 = np.dtype("<f4")
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
    """Pack a group, casting arrays to their wire dtypes. Does not validate: see validate_group."""
    return _pack(g, _GROUP_CASTS)


def stream_fields(g: TrajectoryGroup) -> dict[bytes | str, bytes]:
    """Fields of the `trajectories` stream entry: the message in `data`, plus `schema` and
    `min_version` as ASCII so a reader can route or drop stale groups without decoding."""
    return {
        "data": encode_group(g),
        "schema": str(g.schema).encode(),
        "min_version": str(g.min_version).encode(),
    }


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


def _unpack(data: bytes | bytearray | memoryview, limits: Limits) -> dict[str, Any]:
    """Unpack a top-level map whose `schema` is known, rejecting oversize input before unpacking."""
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
    if type(schema) is not int or schema != SCHEMA_VERSION:
        raise ValidationError("schema", f"unknown schema {schema!r}, expected {SCHEMA_VERSION}")
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
    """Unpack and fully validate a group (see `validate_group`; `current_version` is passed on).

    Raises `ValidationError`, and only that, for any input that is not a valid group.
    """
    limits = limits or DEFAULT_LIMITS
    d = _unpack(data, limits)
    samples = _take(d, "samples", (list,), "")
    g = TrajectoryGroup(
        run=_take(d, "run", (str,), ""),
        group_id=_take(d, "group_id", (str,), ""),
        prompt_id=_take(d, "prompt_id", (str,), ""),
        release_version=_take(d, "release_version", (int,), ""),
        worker=_take(d, "worker", (str,), ""),
        created_at=_float(d, "created_at", ""),
        finished_at=_float(d, "finished_at", ""),
        prompt_ids=_array(d, "prompt_ids", _I32, ""),
        samples=[_decode_sample(s, f"samples[{i}].") for i, s in enumerate(samples)],
        schema=d["schema"],
    )
    validate_group(g, current_version=current_version, limits=limits)
    return g


def decode_prompt(
    data: bytes | bytearray | memoryview, limits: Limits | None = None
) -> PromptGroup:
    """Unpack and validate a prompt group; raises `ValidationError` and only that."""
    limits = limits or DEFAULT_LIMITS
    d = _unpack(data, limits)
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
