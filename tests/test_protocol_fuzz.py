"""Whatever bytes arrive on a stream, decoding yields a valid object or a ValidationError."""

import contextlib
import dataclasses
from typing import Any

import msgpack
import msgpack.fallback
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from asyncrl.protocol import (
    Limits,
    PromptGroup,
    Sample,
    TrajectoryGroup,
    ValidationError,
    decode_group,
    decode_groups,
    decode_prompt,
    encode_group,
    encode_prompt,
    validate,
    validate_group,
    wire,
)

from sample_groups import group_of

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _valid_group() -> TrajectoryGroup:
    samples = [
        Sample(
            response_ids=np.array([5, 6, 7], np.int32),
            logprobs=np.array([-0.1, -2.0, -0.5], np.float32),
            versions=np.array([1, 1, 2], np.int32),
            reward=0.5,
            finish="length",
            meta={"k": "v"},
            loss_mask=np.array([1, 0, 1], np.uint8) if i else None,
        )
        for i in range(2)
    ]
    return group_of(samples, [1, 2], release_version=1, created_at=1.0, finished_at=2.0)


VALID = encode_group(_valid_group())  # the bulk layout, schema 2
# Without optional arrays: what `decode_groups` takes on its batch path.
VALID_PLAIN = encode_group(
    dataclasses.replace(_valid_group(), samples=[_valid_group().samples[0]] * 2)
)
VALID_1 = encode_group(dataclasses.replace(_valid_group(), schema=1))  # as older workers wrote
VALID_PROMPT = encode_prompt(
    PromptGroup(
        run="r",
        prompt_id="p",
        prompt="hi",
        prompt_ids=np.array([1], np.int32),
        answer="a",
        task="t",
        n=2,
        release_version=0,
    )
)


def decodes_or_rejects(data: bytes, limits: Limits | None = None) -> None:
    """The property under test: a decoded group is valid, anything else is a ValidationError;
    and decoding it in a batch (between valid entries) gives what decoding it alone does."""
    alone: TrajectoryGroup | ValidationError
    try:
        alone = g = decode_group(data, limits)
    except ValidationError as exc:
        alone = exc
    else:
        validate_group(g, limits=limits)
    assert_same_decoding(decode_groups([VALID_PLAIN, data, VALID_PLAIN], limits)[1], alone)
    with contextlib.suppress(ValidationError):
        decode_prompt(data, limits)


def assert_same_decoding(
    got: TrajectoryGroup | ValidationError, want: TrajectoryGroup | ValidationError
) -> None:
    """The same error (reason and message), or groups of the same fields, dtypes and bytes."""
    if isinstance(want, ValidationError):
        assert isinstance(got, ValidationError), got
        assert (got.reason, got.message) == (want.reason, want.message)
        return
    assert isinstance(got, TrajectoryGroup), got
    assert encode_group(got) == encode_group(want)
    for a, b in zip([got, *got.samples], [want, *want.samples], strict=True):
        for name in (f.name for f in dataclasses.fields(a)):
            x, y = getattr(a, name), getattr(b, name)
            assert type(x) is type(y), name
            assert getattr(x, "dtype", None) == getattr(y, "dtype", None), name


@FUZZ
@given(st.binary(max_size=1024))
def test_random_bytes(data: bytes) -> None:
    decodes_or_rejects(data)


_edit = st.one_of(
    st.tuples(st.just("flip"), st.integers(0, len(VALID) - 1), st.integers(1, 255)),
    st.tuples(st.just("insert"), st.integers(0, len(VALID)), st.integers(0, 255)),
    st.tuples(st.just("delete"), st.integers(0, len(VALID) - 1), st.just(0)),
    st.tuples(st.just("truncate"), st.integers(0, len(VALID) - 1), st.just(0)),
)


def _mutate(base: bytes, edits: list[tuple[str, int, int]]) -> bytes:
    data = bytearray(base)
    for op, pos, value in edits:
        pos = min(pos, len(data))
        if op == "flip" and pos < len(data):
            data[pos] ^= value
        elif op == "insert":
            data.insert(pos, value)
        elif op == "delete" and pos < len(data):
            del data[pos]
        elif op == "truncate":
            del data[pos:]
    return bytes(data)


@FUZZ
@given(st.sampled_from([VALID, VALID_1, VALID_PLAIN]), st.lists(_edit, min_size=1, max_size=4))
def test_mutated_valid_group(valid: bytes, edits: list[tuple[str, int, int]]) -> None:
    decodes_or_rejects(_mutate(valid, edits))


@FUZZ
@given(st.lists(_edit, min_size=1, max_size=4))
def test_mutated_valid_prompt(edits: list[tuple[str, int, int]]) -> None:
    decodes_or_rejects(_mutate(VALID_PROMPT, edits))


_scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=8)
    | st.binary(max_size=16)
)
_objects = st.recursive(
    _scalars,
    lambda children: (
        st.lists(children, max_size=4)
        | st.dictionaries(st.text(max_size=12) | st.binary(max_size=4), children, max_size=4)
    ),
    max_leaves=20,
)


@FUZZ
@given(_objects)
def test_random_msgpack_objects(obj: Any) -> None:
    decodes_or_rejects(msgpack.packb(obj))


# Paths into schema 1's layout, then into the bulk layout's.
_GROUP_PATHS = [
    ("run",),
    ("release_version",),
    ("created_at",),
    ("prompt_ids",),
    ("samples",),
    ("samples", 0),
    ("samples", 1, "response_ids"),
    ("samples", 1, "logprobs"),
    ("samples", 1, "versions"),
    ("samples", 1, "loss_mask"),
    ("samples", 0, "reward"),
    ("samples", 0, "finish"),
    ("samples", 0, "meta"),
    ("samples", 0, "meta", "k"),
]
_BULK_PATHS = [
    ("lengths",),
    ("response_ids",),
    ("logprobs",),
    ("versions",),
    ("rewards",),
    ("finish",),
    ("meta",),
    ("meta", 1),
    ("meta", 0, "k"),
    ("has",),
    ("loss_mask",),
    ("routed_experts",),
    ("routed_shape",),
]


@FUZZ
@given(
    st.sampled_from(_GROUP_PATHS),
    # Raw bytes of any length, or whole float32/int32 values that reach the semantic checks.
    st.binary(max_size=24) | st.binary(max_size=24).map(lambda b: b[: len(b) // 4 * 4]) | _objects,
)
def test_one_field_of_a_valid_group_replaced(path: tuple[Any, ...], value: Any) -> None:
    # Random objects alone rarely get past the schema check; this reaches the field checks.
    decodes_or_rejects(_replaced(VALID_1, path, value))


def _replaced(valid: bytes, path: tuple[Any, ...], value: Any) -> bytes:
    wire = msgpack.unpackb(valid)
    target = wire
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    return msgpack.packb(wire)


@FUZZ
@given(
    st.sampled_from([*_BULK_PATHS, ("run",), ("prompt_ids",)]),
    # Raw bytes, whole 4- or 8-byte values, or a few small ints (lengths, codes, flags).
    st.binary(max_size=48)
    | st.binary(max_size=48).map(lambda b: b[: len(b) // 4 * 4])
    | st.binary(max_size=48).map(lambda b: b[: len(b) // 8 * 8])
    | st.lists(st.integers(0, 7), max_size=3).map(bytes)
    | _objects,
)
def test_one_field_of_a_valid_bulk_group_replaced(path: tuple[Any, ...], value: Any) -> None:
    decodes_or_rejects(_replaced(VALID, path, value))
    if path[0] not in ("has", "loss_mask", "routed_experts", "routed_shape"):
        decodes_or_rejects(_replaced(VALID_PLAIN, path, value))


@pytest.mark.parametrize("unpackb", [msgpack.unpackb, msgpack.fallback.unpackb])
@pytest.mark.parametrize("opener", [b"\x91", b"\x81\xa1k", b"\xdc\x00\x01"])
def test_deep_nesting_is_rejected(
    monkeypatch: pytest.MonkeyPatch, unpackb: Any, opener: bytes
) -> None:
    # The C unpacker has a fixed stack; the pure-Python fallback recurses, so both are checked.
    monkeypatch.setattr(wire.msgpack, "unpackb", unpackb)
    data = opener * 100_000 + b"\xc0"
    with pytest.raises(ValidationError) as info:
        decode_group(data)
    assert info.value.reason == "malformed"


def test_oversize_input_is_rejected_before_unpacking(monkeypatch: pytest.MonkeyPatch) -> None:
    def must_not_unpack(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("unpackb called on an oversize message")

    monkeypatch.setattr(wire.msgpack, "unpackb", must_not_unpack)
    limits = Limits(max_message_bytes=1024)
    for decode in (decode_group, decode_prompt):
        with pytest.raises(ValidationError) as info:
            decode(b"\x00" * 1025, limits)
        assert info.value.reason == "too_large"


VOCAB_16 = Limits(vocab_size=16)


@FUZZ
@given(
    st.sampled_from(
        [(VALID_1, ("prompt_ids",)), (VALID_1, ("samples", 1, "response_ids")), (VALID, ("ids",))]
    ),
    # Three ids: as many as the sample's log-probs, so only the ids themselves can be wrong.
    st.lists(st.integers(-(2**31), 2**31 - 1) | st.integers(-2, 18), min_size=3, max_size=3),
)
def test_token_ids_decode_only_inside_the_vocabulary(
    where: tuple[bytes, tuple[Any, ...]], ids: list[int]
) -> None:
    valid, path = where
    wire = msgpack.unpackb(valid)
    if path == ("ids",):  # the bulk layout: the second sample's three ids, after the first's
        path = ("response_ids",)
        ids = np.frombuffer(wire["response_ids"], "<i4")[:3].tolist() + ids
    target = wire
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = np.array(ids, "<i4").tobytes()
    inside = all(0 <= t < 16 for t in ids)
    prompt = msgpack.unpackb(VALID_PROMPT)
    prompt["prompt_ids"] = np.array(ids, "<i4").tobytes()
    for decode, data in ((decode_group, wire), (decode_prompt, prompt)):
        try:
            decode(msgpack.packb(data), VOCAB_16)
        except ValidationError as exc:
            assert not inside and exc.reason == "token_out_of_range", exc
        else:
            assert inside


def _first_broken_rule(samples: list[Sample], vocab: int, current: int | None) -> str | None:
    """The token rules of `validate_group`, written out one value at a time in their order."""
    ids = [int(t) for s in samples for t in s.response_ids]
    logprobs = [float(x) for s in samples for x in s.logprobs]
    versions = [int(v) for s in samples for v in s.versions]
    rules = [
        ("token_out_of_range", any(not 0 <= t < vocab for t in ids)),
        ("logprob_not_finite", not all(np.isfinite(x) for x in logprobs)),
        ("logprob_positive", any(x > 0 for x in logprobs)),
        ("version_negative", any(v < 0 for v in versions)),
        ("version_ahead", current is not None and any(v > current for v in versions)),
        (
            "versions_decreasing",
            any(
                b < a for s in samples for a, b in zip(s.versions[:-1], s.versions[1:], strict=True)
            ),
        ),
    ]
    return next((reason for reason, broken in rules if broken), None)


# Valid values drawn four times as often as each broken one, so that groups also get past the
# earlier rules to the later ones.
_IDS = [0, 5, 15] * 4 + [-(2**31), -1, 16, 2**31 - 1]
_LOGPROBS = [-1.5, -0.0, 0.0, -3e38] * 4 + [1e-30, 0.5, np.nan, np.inf, -np.inf]
_VERSIONS = [0, 1, 2, 3] * 4 + [-1, 9, 2**31 - 1]
_token_arrays = st.integers(0, 6).flatmap(
    lambda n: st.tuples(
        st.lists(st.sampled_from(_IDS), min_size=n, max_size=n),
        st.lists(st.sampled_from(_LOGPROBS), min_size=n, max_size=n),
        # Mostly non-decreasing, as engines write them; a sample may still start below the
        # previous one's end, which is no decrease within a sample.
        st.lists(st.sampled_from(_VERSIONS), min_size=n, max_size=n).map(sorted)
        | st.lists(st.sampled_from(_VERSIONS), min_size=n, max_size=n),
    )
)


@FUZZ
@given(st.lists(_token_arrays, min_size=1, max_size=4), st.sampled_from([None, 2, 3, 9]))
def test_token_rules_match_their_plain_reading_on_both_paths(
    arrays: list[tuple[list[int], list[float], list[int]]], current: int | None
) -> None:
    samples = [
        Sample(
            response_ids=np.array(ids, np.int32),
            logprobs=np.array(lps, np.float32),
            versions=np.array(vs, np.int32),
            reward=0.0,
            finish="stop",
        )
        for ids, lps, vs in arrays
    ]
    group = _valid_group()
    group.samples = samples
    expected = _first_broken_rule(samples, 16, current)
    try:  # the bulk layout, checked on the wire's arrays
        decode_group(encode_group(group), VOCAB_16, current_version=current)
        got = None
    except ValidationError as exc:
        got = exc.reason
    assert got == expected, ("bulk", got, expected)
    # In a batch, the token rules run over all its entries joined: each entry still gets its own.
    other = encode_group(dataclasses.replace(group, samples=[_valid_group().samples[0]]))
    batch = decode_groups([other, encode_group(group), other], VOCAB_16, current_version=current)
    got = batch[1].reason if isinstance(batch[1], ValidationError) else None
    assert got == expected, ("batch", got, expected)
    assert not any(isinstance(g, ValidationError) for g in batch[::2])  # versions <= 2
    saved = validate.CONCAT_MAX_TOKENS
    try:
        for split in (False, True):  # concatenated, and sample by sample as long groups are
            validate.CONCAT_MAX_TOKENS = 0 if split else saved
            try:
                validate_group(group, current_version=current, limits=VOCAB_16)
                got = None
            except ValidationError as exc:
                got = exc.reason
            assert got == expected, (split, got, expected)
    finally:
        validate.CONCAT_MAX_TOKENS = saved
