"""Wire format of the `prompts` and `trajectories` streams (msgpack, schema version 1).

Every message is a msgpack map with string keys, so any msgpack library in any language can read
it. Arrays travel as msgpack `bin` holding raw little-endian values (int32, float32 or uint8) and
are decoded with `np.frombuffer`: the decoded arrays are read-only views of the bytes that msgpack
unpacked, and keep dtype `<i4`/`<f4` (native on little-endian hosts; still correct, only slower,
on big-endian ones).

Reading is the trust boundary: `decode_group` and `decode_prompt` reject anything oversize,
malformed or semantically wrong with a `ValidationError` (and nothing else), so one bad stream entry
is dead-lettered instead of taking down a worker. A decoded object has always passed validation.
Keys that schema 1 does not know are ignored, so optional fields can be added without a new schema.

This module imports only numpy and msgpack: rollout workers, the queue and `asyncrl status` use it
without loading torch.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field, fields, replace
from typing import Any, Literal

import msgpack
import numpy as np

SCHEMA_VERSION = 1

Finish = Literal["stop", "length", "abort"]
FINISH_REASONS: frozenset[str] = frozenset({"stop", "length", "abort"})

# Reasons are short and stable: they become the `reason` label of the dropped/dead-letter metrics
# and the reason field of `dlq` entries.
Reason = Literal[
    "schema",
    "malformed",
    "too_large",
    "length_mismatch",
    "logprob_not_finite",
    "logprob_positive",
    "versions_decreasing",
    "version_ahead",
    "version_negative",
    "reward_not_finite",
    "finish",
    "loss_mask",
    "token_out_of_range",
    "routing_shape",
    "routing_out_of_range",
]

# Meta maps must be flat: with scalar values only, a message nests at most four levels deep.
MetaValue = None | bool | int | float | str
_META_TYPES = frozenset({type(None), bool, int, float, str})

_I32 = np.dtype("<i4")
_F32 = np.dtype("<f4")
_U8 = np.dtype("u1")
_U16 = np.dtype("<u2")

# Upper bound on map sizes apart from meta: a group or sample map has about ten keys; the slack
# leaves room for optional keys added later within schema 1.
_MAX_STRUCT_KEYS = 32


class ValidationError(ValueError):
    """A message that must not be used; `reason` is one of `Reason`, the message is for humans."""

    def __init__(self, reason: Reason, message: str) -> None:
        # Both go into args so the exception survives pickling across process pools.
        super().__init__(reason, message)
        self.reason: Reason = reason
        self.message = message

    def __str__(self) -> str:
        return f"{self.reason}: {self.message}"


@dataclass(frozen=True, slots=True)
class Limits:
    """Bounds a reader enforces before trusting a message."""

    # Encoded size; checked before unpacking, so an oversize entry costs nothing to reject.
    max_message_bytes: int = 64 * 2**20
    # Samples in one trajectory group, and `n` of a prompt group.
    max_samples: int = 1024
    # Response tokens of one sample.
    max_response_tokens: int = 131072
    # Prompt tokens of one group.
    max_prompt_tokens: int = 131072
    # Prompt and response tokens of one sample: the model's positions, past which it never ran.
    max_positions: int | None = None
    # Keys in one `meta` map.
    max_meta_keys: int = 64
    # Approximate size of one `meta` map: string lengths plus 8 per non-string value.
    max_meta_bytes: int = 16384
    # Token ids (prompt and response) must lie in [0, vocab_size): the model's embedding rows,
    # which an id outside them would index past. None checks only that none is negative.
    vocab_size: int | None = None
    # Routed experts (MoE models): ids must lie in [0, num_experts), and each token's routing
    # must have `moe_layers` rows of `moe_top_k` ids. None checks only that the samples of a
    # group agree with each other.
    num_experts: int | None = None
    moe_layers: int | None = None
    moe_top_k: int | None = None

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if value is not None and value < 1:
                raise ValueError(f"Limits.{f.name} must be >= 1, got {value}")


DEFAULT_LIMITS = Limits()

# Tokens of a group above which `validate_group` checks its arrays sample by sample rather than
# concatenated (decoding measured: concatenated is cheaper at 8 × 4 k tokens, split at 8 × 16 k).
_CONCAT_MAX_TOKENS = 32768


# The wire types are slotted but not frozen: a frozen __init__ costs about 2 µs more per object,
# a large share of decoding a group. eq=False because array fields have no single truth value.
@dataclass(slots=True, eq=False)
class Sample:
    """One generated response of a group."""

    # Generated token ids, int32.
    response_ids: np.ndarray
    # Behaviour log-prob of each response token under the distribution actually sampled from
    # (after temperature/top-p), float32, finite and <= 0.
    logprobs: np.ndarray
    # Policy version whose weights produced each token's logits, int32, non-decreasing (an engine
    # that swaps weights mid-sequence gives later tokens the newer version).
    versions: np.ndarray
    # Scalar reward from the verifier; finite.
    reward: float
    # Why generation ended: "stop" (EOS/stop string), "length" (token budget), "abort" (cut short).
    finish: Finish
    # Small flat map of scalars for diagnostics (verifier details, turn count); not trained on.
    meta: dict[str, MetaValue] = field(default_factory=dict)
    # uint8, 1 for tokens the policy generated and is trained on, 0 for observation tokens an
    # environment inserted in multi-turn episodes (those carry logprob 0 and still a version).
    # None means every response token is trained on; it is then absent from the wire.
    loss_mask: np.ndarray | None = None
    # float32, the log-prob of each response token recomputed by the worker's mismatch audit
    # (`rollout.audit_fraction`): the same weights as `logprobs`, through the trainer's forward
    # path, finite and <= 0 (0 on observation tokens). None means not audited; absent from the
    # wire then (and in entries of writers that predate it).
    audit_logprobs: np.ndarray | None = None
    # uint16 [prompt + response tokens − 1, MoE layers, top-k]: the experts the engine routed
    # each token it fed through the model to, per MoE layer (the last response token is never
    # fed). Row p is input position p of prompt + response, so the trainer can replay the
    # routing (`algo.routing_replay`). On the wire: `routed_experts` (the ids, little-endian)
    # and `routed_shape` ([layers, top-k]). None: not captured; absent from the wire then.
    routed_experts: np.ndarray | None = None


@dataclass(slots=True, eq=False)
class TrajectoryGroup:
    """All samples generated for one prompt: one entry of the `trajectories` stream."""

    # Run id; a reader may reject groups of another run.
    run: str
    # Id of the `prompts` stream entry this group answers (what the trainer acks upstream).
    group_id: str
    # Dataset id of the prompt, stable across restarts and re-releases.
    prompt_id: str
    # Trainer version when the prompt was released. Tokens may carry newer versions (weights
    # swapped after release), never older ones in practice, but only versions >= 0 are enforced.
    release_version: int
    # Id of the rollout worker that generated the group.
    worker: str
    # Unix seconds when the worker took the prompt, and when the last sample finished.
    created_at: float
    finished_at: float
    # Prompt token ids, int32, shared by all samples.
    prompt_ids: np.ndarray
    # The n responses, in generation order; at least one (a group of none trains nothing).
    samples: list[Sample]
    # Wire schema version; readers reject any other.
    schema: int = SCHEMA_VERSION

    @property
    def min_version(self) -> int:
        """Oldest version among all response tokens, which is what staleness is measured from.

        A group without response tokens has nothing stale in it; it reports `release_version`, so
        it ages like any other group released at the same time.
        """
        # The ufunc itself: ndarray.min's Python wrapper costs more than a short sample's pass.
        mins = [int(np.minimum.reduce(s.versions)) for s in self.samples if len(s.versions)]
        return min(mins) if mins else self.release_version

    @property
    def num_tokens(self) -> int:
        """Response tokens over all samples (prompt tokens not counted)."""
        return sum(len(s.response_ids) for s in self.samples)


@dataclass(slots=True, eq=False)
class PromptGroup:
    """One entry of the `prompts` stream: a prompt to sample `n` responses for."""

    # Run id.
    run: str
    # Dataset id of the prompt, stable across restarts and re-releases.
    prompt_id: str
    # Prompt text as the dataset gives it (chat template not applied); may be empty if
    # `prompt_ids` is given.
    prompt: str
    # Prompt token ids, int32; empty means the worker tokenizes `prompt` itself.
    prompt_ids: np.ndarray
    # Reference answer handed to the verifier; empty when the task has none. Any other plain
    # value (number, bool, list, string-keyed map: see `plain_value_problem`) travels as JSON
    # text in the `answer_json` field, beside an empty `answer`.
    answer: Any
    # Task name, selecting the verifier/environment.
    task: str
    # Number of samples to generate, 1..max_samples.
    n: int
    # Trainer version when the prompt was released, >= 0.
    release_version: int
    # Small flat map of scalars the verifier or environment may need.
    meta: dict[str, MetaValue] = field(default_factory=dict)
    # Wire schema version; readers reject any other.
    schema: int = SCHEMA_VERSION


# ---------------------------------------------------------------------------------------------
# encoding


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


# ---------------------------------------------------------------------------------------------
# decoding


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


# ---------------------------------------------------------------------------------------------
# validation


def _check_meta(meta: Any, limits: Limits, where: str) -> None:
    if type(meta) is not dict:
        raise ValidationError("malformed", f"{where}meta: expected a map")
    if len(meta) > limits.max_meta_keys:
        raise ValidationError(
            "too_large", f"{where}meta: {len(meta)} keys exceeds {limits.max_meta_keys}"
        )
    size = 0
    for key, value in meta.items():
        if type(key) is not str or type(value) not in _META_TYPES:
            raise ValidationError(
                "malformed", f"{where}meta[{key!r}]: keys must be str and values scalars"
            )
        size += len(key) + (len(value) if type(value) is str else 8)
    if size > limits.max_meta_bytes:
        raise ValidationError(
            "too_large", f"{where}meta: about {size} bytes exceeds {limits.max_meta_bytes}"
        )


def _within(ids: np.ndarray, vocab: int | None) -> bool:
    """Whether every id lies in [0, vocab) (vocab None: is >= 0). Signed integers are read as
    unsigned, where a negative one is at least 2**(bits - 1): one pass, not a min and a max."""
    if ids.dtype.kind != "i":
        return bool(ids.min() >= 0 and (vocab is None or ids.max() < vocab))
    sign = 2 ** (8 * ids.dtype.itemsize - 1)
    unsigned = ids.view(ids.dtype.str.replace("i", "u"))
    return int(np.maximum.reduce(unsigned)) < (sign if vocab is None else min(vocab, sign))


def _logprobs_ok(values: np.ndarray) -> bool:
    """Whether all values are finite and <= 0, in two reductions that allocate nothing: NaN makes
    both fail, +inf and positives fail the max, -inf the min."""
    return bool(np.maximum.reduce(values) <= 0 and np.minimum.reduce(values) > -np.inf)


def _check_ids(
    ids: np.ndarray, limits: Limits, where: str, sample_of: Callable[[int], int] | None = None
) -> None:
    """Reject an id no model can embed: negative, or not below `limits.vocab_size`. `sample_of`
    maps an index into concatenated responses back to its sample, for the message."""
    vocab = limits.vocab_size
    if not len(ids) or _within(ids, vocab):
        return
    bad = ids < 0 if vocab is None else (ids < 0) | (ids >= vocab)
    first = int(np.argmax(bad))
    token = int(ids[first])
    if sample_of is not None:
        where = f"samples[{sample_of(first)}].{where}"
    why = "< 0" if token < 0 else f">= vocab size {vocab}"
    raise ValidationError("token_out_of_range", f"{where} has token id {token} {why}")


def validate_group(
    g: TrajectoryGroup, *, current_version: int | None = None, limits: Limits | None = None
) -> None:
    """Raise `ValidationError` unless the group is safe to train on.

    Checks: known schema; sample, prompt and response sizes within `limits`; prompt and response
    token ids >= 0 and below `limits.vocab_size`; response_ids, logprobs, versions (and
    loss_mask, audit_logprobs) of equal length; logprobs and audit_logprobs finite and <= 0;
    versions >= 0, non-decreasing within each sample and, when `current_version` is given, not
    ahead of it; loss_mask 0/1; reward finite; finish known; meta flat and small; routed experts
    one row per fed token, of the model's layers × top-k, ids below its expert count. Token checks
    run once over all samples concatenated, so the cost does not grow with the number of
    samples in Python.
    """
    limits = limits or DEFAULT_LIMITS
    if g.schema != SCHEMA_VERSION:
        raise ValidationError("schema", f"unknown schema {g.schema!r}, expected {SCHEMA_VERSION}")
    if len(g.samples) > limits.max_samples:
        raise ValidationError("too_large", f"{len(g.samples)} samples exceeds {limits.max_samples}")
    if not g.samples:
        raise ValidationError("malformed", "group has no samples")
    if len(g.prompt_ids) > limits.max_prompt_tokens:
        raise ValidationError(
            "too_large", f"{len(g.prompt_ids)} prompt tokens exceeds {limits.max_prompt_tokens}"
        )
    if g.release_version < 0:
        raise ValidationError("version_negative", f"release_version {g.release_version} < 0")
    _check_ids(g.prompt_ids, limits, "prompt_ids")

    lengths = []
    for i, s in enumerate(g.samples):
        where = f"samples[{i}]."
        n = len(s.response_ids)
        if n > limits.max_response_tokens:
            raise ValidationError(
                "too_large", f"{where}response_ids: {n} tokens exceeds {limits.max_response_tokens}"
            )
        if limits.max_positions is not None and len(g.prompt_ids) + n > limits.max_positions:
            raise ValidationError(
                "too_large",
                f"{where}response_ids: {len(g.prompt_ids)} + {n} tokens pass "
                f"{limits.max_positions} positions",
            )
        if (
            len(s.logprobs) != n
            or len(s.versions) != n
            or (s.loss_mask is not None and len(s.loss_mask) != n)
            or (s.audit_logprobs is not None and len(s.audit_logprobs) != n)
        ):
            mask = "no" if s.loss_mask is None else len(s.loss_mask)
            audit = "no" if s.audit_logprobs is None else len(s.audit_logprobs)
            raise ValidationError(
                "length_mismatch",
                f"samples[{i}]: {n} response_ids, {len(s.logprobs)} logprobs, "
                f"{len(s.versions)} versions, {mask} loss_mask, {audit} audit_logprobs",
            )
        if not math.isfinite(s.reward):
            raise ValidationError("reward_not_finite", f"{where}reward is {s.reward}")
        if s.finish not in FINISH_REASONS:
            raise ValidationError(
                "finish", f"{where}finish {s.finish!r} not in {sorted(FINISH_REASONS)}"
            )
        _check_meta(s.meta, limits, where)
        lengths.append(n)
    _check_routing(g, limits)
    total = sum(lengths)
    if not total:
        return
    # A short group's arrays are checked concatenated, one numpy call per check; a long group's
    # sample by sample on the decoded views, where a concatenation would copy (and fault in)
    # megabytes. Where a check fails, the concatenation names the sample.
    split = total > _CONCAT_MAX_TOKENS

    def runs(arrays: list[np.ndarray]) -> list[np.ndarray]:
        return arrays if split else [np.concatenate(arrays)]

    def sample_of(flat_index: int) -> int:
        """The sample of a token of the concatenation, for an error message."""
        return int(np.searchsorted(np.cumsum(lengths), flat_index, side="right"))

    used = [s for s in g.samples if len(s.response_ids)]
    ids = [s.response_ids for s in used]
    if not all(_within(r, limits.vocab_size) for r in runs(ids)):
        _check_ids(np.concatenate(ids), limits, "response_ids", sample_of)

    # Audited log-probs run the same checks as the behaviour ones, under the same reason codes.
    audited = [s.audit_logprobs for s in g.samples if s.audit_logprobs is not None]
    for a in audited:
        if len(a) and not _logprobs_ok(a):
            if not np.isfinite(a).all():
                raise ValidationError("logprob_not_finite", "audit_logprobs has NaN or inf")
            raise ValidationError("logprob_positive", "audit_logprobs has a value > 0")
    logprobs = [s.logprobs for s in used]
    if not all(_logprobs_ok(r) for r in runs(logprobs)):
        flat = np.concatenate(logprobs)
        finite = np.isfinite(flat)
        if not finite.all():
            i = sample_of(int(np.argmin(finite)))
            raise ValidationError("logprob_not_finite", f"samples[{i}].logprobs has NaN or inf")
        i = sample_of(int(np.argmax(flat > 0)))
        raise ValidationError("logprob_positive", f"samples[{i}].logprobs has a value > 0")

    # In a concatenation a decrease from one sample's end to the next one's start is none within
    # a sample: counting those from the samples' ends tells whether the one pass over the tokens
    # found any other. A non-decreasing sample has its extremes at its ends.
    versions = [s.versions for s in used]
    firsts, lasts = [int(v[0]) for v in versions], [int(v[-1]) for v in versions]
    between = 0 if split else sum(b < a for a, b in zip(lasts, firsts[1:], strict=False))
    decreasing = sum(int(np.count_nonzero(v[1:] < v[:-1])) for v in runs(versions)) != between
    joined = np.concatenate(versions) if decreasing or min(firsts) < 0 else None
    if joined is not None and joined.min() < 0:
        i = sample_of(int(np.argmin(joined)))
        raise ValidationError("version_negative", f"samples[{i}].versions has a value < 0")
    high = max(lasts) if joined is None else int(joined.max())
    if current_version is not None and high > current_version:
        i = sample_of(int(np.argmax(np.concatenate(versions))))
        raise ValidationError(
            "version_ahead", f"samples[{i}].versions has {high} > current {current_version}"
        )
    if decreasing:
        i = next(i for i, s in enumerate(g.samples) if (s.versions[1:] < s.versions[:-1]).any())
        raise ValidationError("versions_decreasing", f"samples[{i}].versions decrease")

    masks = [s.loss_mask for s in g.samples if s.loss_mask is not None and len(s.loss_mask)]
    if masks and np.concatenate(masks).max() > 1:
        raise ValidationError("loss_mask", "loss_mask values must be 0 or 1")


def _check_routing(g: TrajectoryGroup, limits: Limits) -> None:
    """Routed experts: one row per fed token (prompt + response − 1), the same [layers, top-k]
    in every sample and as `limits` say, ids below `limits.num_experts`."""
    shapes = set()
    for i, s in enumerate(g.samples):
        r = s.routed_experts
        if r is None:
            continue
        fed = len(g.prompt_ids) + len(s.response_ids) - 1
        if r.ndim != 3 or len(r) != fed:
            raise ValidationError(
                "routing_shape",
                f"samples[{i}].routed_experts has shape {r.shape}, expected {fed} token rows",
            )
        shapes.add(r.shape[1:])
        if limits.num_experts is not None and r.size and int(r.max()) >= limits.num_experts:
            raise ValidationError(
                "routing_out_of_range",
                f"samples[{i}].routed_experts has expert {int(r.max())} >= {limits.num_experts}",
            )
    want = (limits.moe_layers, limits.moe_top_k)
    if len(shapes) > 1 or (shapes and None not in want and shapes != {want}):
        raise ValidationError(
            "routing_shape",
            f"routed_experts rows of {sorted(shapes)} (layers, top-k); the model has {want}",
        )


def validate_prompt(p: PromptGroup, *, limits: Limits | None = None) -> None:
    """Raise `ValidationError` unless the prompt group can be worked on."""
    limits = limits or DEFAULT_LIMITS
    if p.schema != SCHEMA_VERSION:
        raise ValidationError("schema", f"unknown schema {p.schema!r}, expected {SCHEMA_VERSION}")
    if p.n < 1:
        raise ValidationError("malformed", f"n={p.n}, must be >= 1")
    if p.n > limits.max_samples:
        raise ValidationError("too_large", f"n={p.n} exceeds {limits.max_samples}")
    if len(p.prompt_ids) > limits.max_prompt_tokens:
        raise ValidationError(
            "too_large", f"{len(p.prompt_ids)} prompt tokens exceeds {limits.max_prompt_tokens}"
        )
    if not p.prompt and not len(p.prompt_ids):
        raise ValidationError("malformed", "neither prompt text nor prompt_ids given")
    _check_ids(p.prompt_ids, limits, "prompt_ids")
    if p.release_version < 0:
        raise ValidationError("version_negative", f"release_version {p.release_version} < 0")
    _check_meta(p.meta, limits, "")
