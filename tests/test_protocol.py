import dataclasses
import pickle
from collections.abc import Callable
from typing import Any

import msgpack
import numpy as np
import pytest

from asyncrl.protocol import (
    Limits,
    PromptGroup,
    Sample,
    TrajectoryGroup,
    ValidationError,
    batch,
    decode_group,
    decode_groups,
    decode_prompt,
    encode_group,
    encode_prompt,
    stream_fields,
    validate,
    validate_group,
)


def make_sample(n: int = 5, version: int = 3, **overrides: Any) -> Sample:
    fields: dict[str, Any] = {
        "response_ids": np.arange(100, 100 + n, dtype=np.int32),
        "logprobs": -np.linspace(0.0, 2.0, n, dtype=np.float32),
        "versions": np.full(n, version, dtype=np.int32),
        "reward": 1.0,
        "finish": "stop",
        "meta": {"verifier": "math", "turns": 1},
    }
    fields.update(overrides)
    return Sample(**fields)


def make_group(samples: list[Sample] | None = None, **overrides: Any) -> TrajectoryGroup:
    fields: dict[str, Any] = {
        "run": "r1",
        "group_id": "1700000000000-0",
        "prompt_id": "gsm8k-7",
        "release_version": 2,
        "worker": "rollout-0",
        "created_at": 1.7e9,
        "finished_at": 1.7e9 + 2.5,
        "prompt_ids": np.arange(7, dtype=np.int32),
        "samples": samples if samples is not None else [make_sample(), make_sample(version=4)],
    }
    fields.update(overrides)
    return TrajectoryGroup(**fields)


def make_prompt(**overrides: Any) -> PromptGroup:
    fields: dict[str, Any] = {
        "run": "r1",
        "prompt_id": "gsm8k-7",
        "prompt": "What is 2 + 2?",
        "prompt_ids": np.array([1, 2, 3], dtype=np.int32),
        "answer": "4",
        "task": "gsm8k",
        "n": 8,
        "release_version": 2,
        "meta": {"split": "train"},
    }
    fields.update(overrides)
    return PromptGroup(**fields)


def repack(g: TrajectoryGroup, edit: Callable[[dict[str, Any]], None]) -> bytes:
    """Encode g, then edit the plain msgpack map, as a foreign or broken producer would."""
    wire = msgpack.unpackb(encode_group(g))
    edit(wire)
    return msgpack.packb(wire)


def reason_of(data: bytes, **kwargs: Any) -> str:
    with pytest.raises(ValidationError) as info:
        decode_group(data, **kwargs)
    return info.value.reason


# ---------------------------------------------------------------------------------------------
# round trip and wire shape


def test_group_round_trip_keeps_every_field_and_dtype() -> None:
    mask = np.array([1, 1, 0, 0, 1], dtype=np.uint8)
    g = make_group([make_sample(loss_mask=mask), make_sample(n=0, reward=0.0, finish="abort")])
    out = decode_group(encode_group(g))
    for name in ("run", "group_id", "prompt_id", "release_version", "worker", "schema"):
        assert getattr(out, name) == getattr(g, name)
    assert (out.created_at, out.finished_at) == (g.created_at, g.finished_at)
    assert out.prompt_ids.dtype == np.dtype("<i4")
    np.testing.assert_array_equal(out.prompt_ids, g.prompt_ids)
    assert len(out.samples) == 2
    for a, b in zip(out.samples, g.samples, strict=True):
        assert a.response_ids.dtype == np.dtype("<i4")
        assert a.logprobs.dtype == np.dtype("<f4")
        assert a.versions.dtype == np.dtype("<i4")
        np.testing.assert_array_equal(a.response_ids, b.response_ids)
        np.testing.assert_array_equal(a.logprobs, b.logprobs)
        np.testing.assert_array_equal(a.versions, b.versions)
        assert (a.reward, a.finish, a.meta) == (b.reward, b.finish, b.meta)
    assert out.samples[0].loss_mask is not None
    assert out.samples[0].loss_mask.dtype == np.uint8
    np.testing.assert_array_equal(out.samples[0].loss_mask, mask)
    assert out.samples[1].loss_mask is None


def test_decoded_arrays_are_read_only_views() -> None:
    out = decode_group(encode_group(make_group()))
    assert not out.samples[0].logprobs.flags.writeable
    with pytest.raises(ValueError):
        out.samples[0].logprobs[0] = 0.0


def test_plain_msgpack_reads_the_bulk_layout() -> None:
    g = make_group([make_sample(), make_sample(n=3, version=4, reward=0.5, finish="length")])
    wire = msgpack.unpackb(encode_group(g), strict_map_key=True)
    assert all(isinstance(k, str) for k in wire)
    assert wire["schema"] == 2
    assert "samples" not in wire and "has" not in wire  # no optional arrays in this group
    assert wire["prompt_ids"] == np.arange(7, dtype="<i4").tobytes()
    assert np.frombuffer(wire["lengths"], "<i4").tolist() == [5, 3]
    assert np.frombuffer(wire["versions"], "<i4").tolist() == [3] * 5 + [4] * 3
    logprobs = np.concatenate([s.logprobs for s in g.samples]).tolist()
    assert np.frombuffer(wire["logprobs"], "<f4").tolist() == logprobs
    assert np.frombuffer(wire["rewards"], "<f8").tolist() == [1.0, 0.5]
    assert list(wire["finish"]) == [0, 1]  # FINISH_CODES: stop, length
    assert wire["meta"] == [s.meta for s in g.samples]


def test_plain_msgpack_reads_string_keys_and_little_endian_bytes_in_schema_1() -> None:
    g = make_group(schema=1)
    wire = msgpack.unpackb(encode_group(g), strict_map_key=True)
    assert all(isinstance(k, str) for k in wire)
    assert wire["schema"] == 1
    assert wire["prompt_ids"] == np.arange(7, dtype="<i4").tobytes()
    sample = wire["samples"][1]
    assert set(sample) == {"response_ids", "logprobs", "versions", "reward", "finish", "meta"}
    assert np.frombuffer(sample["versions"], "<i4").tolist() == [4] * 5
    assert np.frombuffer(sample["logprobs"], "<f4").tolist() == g.samples[1].logprobs.tolist()


def test_encode_casts_to_little_endian_wire_dtypes() -> None:
    s = make_sample(
        response_ids=np.array([1, 70000, 3], dtype=">i4"),
        logprobs=np.array([-0.5, -1.0, 0.0], dtype=np.float64),
        versions=[0, 0, 1],
    )
    for schema in (1, 2):
        wire = msgpack.unpackb(encode_group(make_group([s], schema=schema)))
        arrays = wire["samples"][0] if schema == 1 else wire
        assert arrays["response_ids"] == np.array([1, 70000, 3], "<i4").tobytes()
        assert arrays["logprobs"] == np.array([-0.5, -1.0, 0.0], "<f4").tobytes()
        assert arrays["versions"] == np.array([0, 0, 1], "<i4").tobytes()


def test_decode_accepts_bytearray_memoryview_ints_for_floats_and_missing_meta() -> None:
    def edit(w: dict[str, Any]) -> None:
        w["created_at"] = 1700000000
        w["samples"][0]["reward"] = 1
        del w["samples"][0]["meta"]
        w["added_in_a_later_producer"] = [1, 2]

    def edit_bulk(w: dict[str, Any]) -> None:
        w["created_at"] = 1700000000
        del w["meta"]
        w["added_in_a_later_producer"] = [1, 2]

    data = repack(make_group(schema=1), edit)
    bulk = repack(make_group(), edit_bulk)
    for buf in (data, bytearray(data), memoryview(data), bulk, bytearray(bulk), memoryview(bulk)):
        out = decode_group(buf)
        assert out.created_at == 1.7e9 and isinstance(out.created_at, float)
        assert out.samples[0].reward == 1.0 and isinstance(out.samples[0].reward, float)
        assert out.samples[0].meta == {}


def test_min_version_num_tokens_and_stream_fields() -> None:
    g = make_group([make_sample(version=5), make_sample(n=3, version=4), make_sample(n=0)])
    assert g.min_version == 4
    assert g.num_tokens == 8
    for schema in (1, 2):
        g.schema = schema
        fields = stream_fields(g)
        assert fields["schema"] == str(schema).encode()
        assert fields["min_version"] == b"4"
        assert decode_group(fields["data"]).min_version == 4
    assert stream_fields(make_group([make_sample(n=0)], release_version=9))["min_version"] == b"9"


def test_min_version_of_group_without_tokens_is_release_version() -> None:
    assert make_group([make_sample(n=0)], release_version=9).min_version == 9
    assert make_group([], release_version=9).min_version == 9


def test_versions_may_increase_within_and_restart_across_samples() -> None:
    rising = make_sample(versions=np.array([2, 2, 3, 5, 5], dtype=np.int32))
    older = make_sample(version=1)
    out = decode_group(encode_group(make_group([rising, older])), current_version=5)
    assert out.min_version == 1


def test_prompt_round_trip_and_plain_msgpack() -> None:
    p = make_prompt()
    data = encode_prompt(p)
    out = decode_prompt(data)
    for name in ("run", "prompt_id", "prompt", "answer", "task", "n", "release_version", "meta"):
        assert getattr(out, name) == getattr(p, name)
    assert out.prompt_ids.dtype == np.dtype("<i4")
    np.testing.assert_array_equal(out.prompt_ids, p.prompt_ids)
    wire = msgpack.unpackb(data)
    assert wire["prompt_ids"] == np.array([1, 2, 3], "<i4").tobytes()
    assert wire["schema"] == 1


def test_prompt_with_text_only_is_valid() -> None:
    out = decode_prompt(encode_prompt(make_prompt(prompt_ids=np.zeros(0, np.int32))))
    assert out.prompt_ids.size == 0


# ---------------------------------------------------------------------------------------------
# one bad group per validation rule


def _with_sample(**overrides: Any) -> TrajectoryGroup:
    return make_group([make_sample(), make_sample(**overrides)])


VOCAB_104 = Limits(vocab_size=104)

BAD_GROUPS: list[tuple[str, TrajectoryGroup, dict[str, Any], str]] = [
    ("schema_unknown", make_group(schema=3), {}, "schema"),
    ("no_samples", make_group([]), {}, "malformed"),
    ("logprobs_short", _with_sample(logprobs=np.zeros(4, np.float32)), {}, "length_mismatch"),
    ("versions_long", _with_sample(versions=np.zeros(6, np.int32)), {}, "length_mismatch"),
    ("loss_mask_short", _with_sample(loss_mask=np.ones(3, np.uint8)), {}, "length_mismatch"),
    ("too_many_tokens", make_group(), {"limits": Limits(max_response_tokens=4)}, "too_large"),
    ("too_many_samples", make_group(), {"limits": Limits(max_samples=1)}, "too_large"),
    ("prompt_too_long", make_group(), {"limits": Limits(max_prompt_tokens=6)}, "too_large"),
    ("message_too_large", make_group(), {"limits": Limits(max_message_bytes=64)}, "too_large"),
    (
        "logprob_nan",
        _with_sample(logprobs=np.array([-1, np.nan, -1, -1, -1], np.float32)),
        {},
        "logprob_not_finite",
    ),
    (
        "logprob_inf",
        _with_sample(logprobs=np.array([-1, -1, -1, -1, -np.inf], np.float32)),
        {},
        "logprob_not_finite",
    ),
    (
        "logprob_positive",
        _with_sample(logprobs=np.array([-1, -1, 0.25, -1, 0], np.float32)),
        {},
        "logprob_positive",
    ),
    (
        "versions_decreasing",
        _with_sample(versions=np.array([3, 4, 4, 3, 4], np.int32)),
        {},
        "versions_decreasing",
    ),
    ("version_ahead", _with_sample(version=9), {"current_version": 8}, "version_ahead"),
    (
        "version_negative",
        _with_sample(versions=np.array([-1, 0, 0, 0, 0], np.int32)),
        {},
        "version_negative",
    ),
    ("release_version_negative", make_group(release_version=-1), {}, "version_negative"),
    ("reward_nan", _with_sample(reward=float("nan")), {}, "reward_not_finite"),
    ("reward_inf", _with_sample(reward=float("inf")), {}, "reward_not_finite"),
    ("finish_unknown", _with_sample(finish="eos"), {}, "finish"),
    ("loss_mask_not_binary", _with_sample(loss_mask=np.full(5, 2, np.uint8)), {}, "loss_mask"),
    (
        "meta_too_many_keys",
        _with_sample(meta={"a": 1, "b": 2, "c": 3}),
        {"limits": Limits(max_meta_keys=2)},
        "too_large",
    ),
    ("meta_too_big", _with_sample(meta={"log": "x" * 20000}), {}, "too_large"),
    # Response ids are 100..104: the last one is the vocabulary's size, one past its end.
    ("response_id_at_vocab_size", make_group(), {"limits": VOCAB_104}, "token_out_of_range"),
    (
        "response_id_negative",
        _with_sample(response_ids=np.array([5, -1, 5, 5, 5], np.int32)),
        {},
        "token_out_of_range",
    ),
    (
        "prompt_id_past_vocab",
        make_group(prompt_ids=np.array([1, 2, 500], np.int32)),
        {"limits": Limits(vocab_size=200)},
        "token_out_of_range",
    ),
    (
        "prompt_id_negative",
        make_group(prompt_ids=np.array([1, -3, 2], np.int32)),
        {},
        "token_out_of_range",
    ),
    ("audit_short", _with_sample(audit_logprobs=np.zeros(4, np.float32)), {}, "length_mismatch"),
    (
        "audit_nan",
        _with_sample(audit_logprobs=np.array([-1, np.nan, -1, -1, -1], np.float32)),
        {},
        "logprob_not_finite",
    ),
    (
        "audit_positive",
        _with_sample(audit_logprobs=np.array([-1, -1, 0.5, -1, 0], np.float32)),
        {},
        "logprob_positive",
    ),
]


def test_audit_logprobs_round_trip_and_are_absent_when_not_audited() -> None:
    audit = -np.linspace(0.0, 2.5, 5, dtype=np.float32)
    group = make_group([make_sample(audit_logprobs=audit), make_sample()])
    back = decode_group(encode_group(group))
    assert back.samples[0].audit_logprobs is not None
    assert back.samples[0].audit_logprobs.dtype == np.float32
    np.testing.assert_array_equal(back.samples[0].audit_logprobs, audit)
    assert back.samples[1].audit_logprobs is None
    # An entry written before the field existed has no such key: it decodes unaudited.
    raw = msgpack.unpackb(encode_group(make_group(schema=1)))
    assert all("audit_logprobs" not in s for s in raw["samples"])
    assert all(s.audit_logprobs is None for s in decode_group(msgpack.packb(raw)).samples)
    assert all(s.audit_logprobs is None for s in decode_group(encode_group(make_group())).samples)


@pytest.mark.parametrize("schema", [1, 2])
@pytest.mark.parametrize(
    ("group", "kwargs", "reason"),
    [case[1:] for case in BAD_GROUPS],
    ids=[case[0] for case in BAD_GROUPS],
)
def test_bad_group_is_rejected_with_its_reason(
    group: TrajectoryGroup, kwargs: dict[str, Any], reason: str, schema: int
) -> None:
    """In either layout: schema 1 as workers of before the bulk codec wrote it, schema 2."""
    if group.schema != 3:
        group = dataclasses.replace(group, schema=schema)
    assert reason_of(encode_group(group), **kwargs) == reason
    if "limits" not in kwargs:
        # The same rule holds for a group checked in process, before it is sent.
        with pytest.raises(ValidationError) as info:
            validate_group(group, current_version=kwargs.get("current_version"))
        assert info.value.reason == reason


def test_version_equal_to_current_is_accepted() -> None:
    decode_group(encode_group(_with_sample(version=8)), current_version=8)


def test_error_names_the_offending_sample() -> None:
    bad = make_sample(versions=np.array([3, 4, 4, 3, 4], np.int32))
    with pytest.raises(ValidationError, match=r"samples\[2\]"):
        validate_group(make_group([make_sample(), make_sample(), bad]))


def test_ids_inside_the_vocabulary_pass_and_the_error_names_the_sample() -> None:
    decode_group(encode_group(make_group()), Limits(vocab_size=105))  # ids 0..104
    # Only the second sample's ids (100..102) reach past the vocabulary.
    g = make_group([make_sample(response_ids=np.arange(3, 8, dtype=np.int32)), make_sample(n=3)])
    with pytest.raises(ValidationError, match=r"samples\[1\]\.response_ids has token id 100 >= "):
        validate_group(g, limits=Limits(vocab_size=50))


def test_decrease_in_a_sample_after_empty_samples_is_found() -> None:
    bad = make_sample(versions=np.array([5, 4, 4, 4, 4], np.int32))
    g = make_group([make_sample(n=0), make_sample(n=0), bad])
    with pytest.raises(ValidationError, match=r"samples\[2\]") as info:
        validate_group(g)
    assert info.value.reason == "versions_decreasing"


# ---------------------------------------------------------------------------------------------
# malformed bytes and wrong types


def _set(path: tuple[Any, ...], value: Any) -> Callable[[dict[str, Any]], None]:
    def edit(w: dict[str, Any]) -> None:
        target: Any = w
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value

    return edit


def _delete(key: str) -> Callable[[dict[str, Any]], None]:
    return lambda w: w.pop(key)


WRONG_TYPES = {
    "run_int": _set(("run",), 5),
    "run_bytes": _set(("run",), b"r1"),
    "release_version_bool": _set(("release_version",), True),
    "release_version_float": _set(("release_version",), 2.0),
    "created_at_str": _set(("created_at",), "now"),
    "prompt_ids_list": _set(("prompt_ids",), [1, 2, 3]),
    "samples_map": _set(("samples",), {"0": {}}),
    "sample_not_map": _set(("samples", 0), [1, 2]),
    "reward_str": _set(("samples", 0, "reward"), "1.0"),
    "finish_bytes": _set(("samples", 0, "finish"), b"stop"),
    "meta_list": _set(("samples", 0, "meta"), [1]),
    "meta_nested": _set(("samples", 0, "meta"), {"a": {"b": 1}}),
    "meta_bytes_key": _set(("samples", 0, "meta"), {b"a": 1}),
    "missing_worker": _delete("worker"),
    "odd_byte_length": _set(("samples", 0, "logprobs"), b"\x00" * 19),
    "odd_prompt_bytes": _set(("prompt_ids",), b"\x00" * 3),
}


@pytest.mark.parametrize("edit", list(WRONG_TYPES.values()), ids=list(WRONG_TYPES))
def test_wrong_types_are_malformed(edit: Callable[[dict[str, Any]], None]) -> None:
    assert reason_of(repack(make_group(schema=1), edit)) == "malformed"


WRONG_BULK = {
    "lengths_list": (_set(("lengths",), [5, 5]), "malformed"),
    "lengths_missing": (_delete("lengths"), "malformed"),
    "lengths_negative": (_set(("lengths",), np.array([6, -1], "<i4").tobytes()), "malformed"),
    "lengths_longer": (_set(("lengths",), np.array([5, 6], "<i4").tobytes()), "length_mismatch"),
    "one_length_more": (_set(("lengths",), np.array([5, 5, 0], "<i4").tobytes()), "malformed"),
    "rewards_one_short": (_set(("rewards",), np.array([1.0], "<f8").tobytes()), "malformed"),
    "rewards_odd_bytes": (_set(("rewards",), b"\x00" * 12), "malformed"),
    "rewards_a_million": (_set(("rewards",), bytes(8 << 20)), "malformed"),
    "has_a_million": (_set(("has",), bytes(1 << 20)), "malformed"),
    "finish_code_unknown": (_set(("finish",), bytes([0, 3])), "finish"),
    "finish_str": (_set(("finish",), "stop"), "malformed"),
    "meta_one_short": (_set(("meta",), [{}]), "malformed"),
    "meta_nested": (_set(("meta", 1), {"a": {"b": 1}}), "malformed"),
    "logprobs_short": (_set(("logprobs",), b"\x00" * 36), "length_mismatch"),
    "versions_list": (_set(("versions",), [3] * 10), "malformed"),
    "has_mask_without_mask": (_set(("has",), bytes([1, 0])), "malformed"),
    "has_one_short": (_set(("has",), bytes([0])), "malformed"),
    "mask_short": (
        lambda w: w.update(has=bytes([0, 1]), loss_mask=bytes(4)),
        "length_mismatch",
    ),
    "routed_without_rows": (
        lambda w: w.update(has=bytes([4, 0]), routed_experts=b"", routed_shape=[1, 1]),
        "routing_shape",
    ),
}


@pytest.mark.parametrize(("edit", "reason"), list(WRONG_BULK.values()), ids=list(WRONG_BULK))
def test_broken_bulk_fields_are_rejected(
    edit: Callable[[dict[str, Any]], None], reason: str
) -> None:
    assert reason_of(repack(make_group(), edit)) == reason


def test_bulk_optional_arrays_round_trip_on_the_samples_that_have_them() -> None:
    mask = np.array([1, 0, 1], np.uint8)
    audit = -np.linspace(0.0, 1.0, 5, dtype=np.float32)
    routed = np.arange(9 * 2 * 3, dtype=np.uint16).reshape(9, 2, 3) % 8  # 7 + 3 - 1 rows
    samples = [
        make_sample(n=3, loss_mask=mask, routed_experts=routed),
        make_sample(audit_logprobs=audit),
        make_sample(n=0, reward=0.0, finish="abort"),
        make_sample(n=2, loss_mask=np.ones(2, np.uint8), audit_logprobs=np.zeros(2, np.float32)),
    ]
    wire = msgpack.unpackb(encode_group(make_group(samples)))
    assert list(wire["has"]) == [1 + 4, 2, 0, 1 + 2]
    assert wire["loss_mask"] == bytes([1, 0, 1, 1, 1]) and wire["routed_shape"] == [2, 3]
    back = decode_group(encode_group(make_group(samples)), Limits(num_experts=8))
    for a, b in zip(back.samples, samples, strict=True):
        for name in ("response_ids", "logprobs", "versions"):
            np.testing.assert_array_equal(getattr(a, name), getattr(b, name))
        for name in ("loss_mask", "audit_logprobs", "routed_experts"):
            got, want = getattr(a, name), getattr(b, name)
            assert (got is None) == (want is None), name
            if want is not None:
                assert got.dtype == want.dtype and not got.flags.writeable
                np.testing.assert_array_equal(got, want)
        assert (a.reward, a.finish, a.meta) == (b.reward, b.finish, b.meta)


def test_an_entry_an_old_worker_wrote_decodes() -> None:
    """Schema 1 as any msgpack writer of before the bulk codec packed it (not our encoder)."""
    sample = {
        "response_ids": np.array([5, 6], "<i4").tobytes(),
        "logprobs": np.array([-0.5, -1.5], "<f4").tobytes(),
        "versions": np.array([2, 3], "<i4").tobytes(),
        "reward": 1,
        "finish": "length",
        "meta": {"turns": 2},
        "loss_mask": bytes([1, 0]),
    }
    old = {
        "schema": 1,
        "run": "r1",
        "group_id": "1-0",
        "prompt_id": "p",
        "release_version": 2,
        "worker": "w",
        "created_at": 1.0,
        "finished_at": 2.0,
        "prompt_ids": np.array([1, 2], "<i4").tobytes(),
        "samples": [sample, {**sample, "loss_mask": bytes([1, 1]), "finish": "stop"}],
    }
    g = decode_group(msgpack.packb(old), current_version=3)
    assert (g.schema, g.min_version, [s.finish for s in g.samples]) == (1, 2, ["length", "stop"])
    assert g.samples[0].loss_mask.tolist() == [1, 0] and g.samples[1].meta == {"turns": 2}
    assert g.samples[1].versions.tolist() == [2, 3] and g.samples[0].reward == 1.0


def test_a_new_reader_takes_old_entries_and_the_same_group_in_both_layouts() -> None:
    """A rolling upgrade: workers of before the bulk codec still write schema 1 entries."""
    g = make_group([make_sample(loss_mask=np.array([1, 1, 0, 0, 1], np.uint8)), make_sample()])
    old, new = (decode_group(encode_group(dataclasses.replace(g, schema=s))) for s in (1, 2))
    assert (old.schema, new.schema) == (1, 2)
    for a, b in zip(old.samples, new.samples, strict=True):
        for name in ("response_ids", "logprobs", "versions"):
            np.testing.assert_array_equal(getattr(a, name), getattr(b, name))
        assert (a.reward, a.finish, a.meta) == (b.reward, b.finish, b.meta)
    np.testing.assert_array_equal(old.samples[0].loss_mask, new.samples[0].loss_mask)
    assert old.samples[1].loss_mask is None and new.samples[1].loss_mask is None


def test_schema_missing_or_not_int_is_schema() -> None:
    assert reason_of(repack(make_group(), _set(("schema",), 3))) == "schema"
    assert reason_of(repack(make_group(), _delete("schema"))) == "schema"
    assert reason_of(repack(make_group(), _set(("schema",), "1"))) == "schema"
    assert reason_of(repack(make_group(), _set(("schema",), True))) == "schema"


MALFORMED_BYTES = {
    "empty": b"",
    "reserved_byte": b"\xc1",
    "truncated": None,
    "trailing_data": None,
    "not_a_map": msgpack.packb([1, 2, 3]),
    "int_key": msgpack.packb({1: 2}),
    "ext_type": msgpack.packb({"schema": 1, "run": msgpack.ExtType(5, b"x")}),
    "timestamp_in_meta": None,
    "bad_utf8": b"\x81\xa6schema\xa2\xff\xfe",
}


def _malformed(name: str) -> bytes:
    good = encode_group(make_group())
    if name == "truncated":
        return good[:-7]
    if name == "trailing_data":
        return good + b"\x00"
    if name == "timestamp_in_meta":
        return repack(make_group(), _set(("meta", 0, "t"), msgpack.Timestamp(0)))
    data = MALFORMED_BYTES[name]
    assert data is not None
    return data


@pytest.mark.parametrize("name", list(MALFORMED_BYTES))
def test_malformed_bytes_are_rejected(name: str) -> None:
    assert reason_of(_malformed(name)) == "malformed"


def test_array_header_beyond_limits_is_too_large() -> None:
    assert reason_of(b"\xdd\xff\xff\xff\xff") == "too_large"


def test_non_bytes_input_is_malformed() -> None:
    with pytest.raises(ValidationError) as info:
        decode_group("not bytes")  # type: ignore[arg-type]
    assert info.value.reason == "malformed"


# ---------------------------------------------------------------------------------------------
# prompts


@pytest.mark.parametrize(
    ("overrides", "limits", "reason"),
    [
        ({"schema": 3}, None, "schema"),
        ({"n": 0}, None, "malformed"),
        ({"n": 9}, Limits(max_samples=8), "too_large"),
        ({"prompt": "", "prompt_ids": np.zeros(0, np.int32)}, None, "malformed"),
        ({"prompt_ids": np.zeros(10, np.int32)}, Limits(max_prompt_tokens=9), "too_large"),
        ({"release_version": -2}, None, "version_negative"),
        ({"meta": {"x": [1]}}, None, "malformed"),
        ({"prompt_ids": np.array([1, 15], np.int32)}, Limits(vocab_size=15), "token_out_of_range"),
        ({"prompt_ids": np.array([-1, 2], np.int32)}, None, "token_out_of_range"),
    ],
    ids=[
        "schema",
        "n_zero",
        "n_too_big",
        "empty",
        "prompt_too_long",
        "version",
        "meta",
        "id_past_vocab",
        "id_negative",
    ],
)
def test_bad_prompt_is_rejected(
    overrides: dict[str, Any], limits: Limits | None, reason: str
) -> None:
    with pytest.raises(ValidationError) as info:
        decode_prompt(encode_prompt(make_prompt(**overrides)), limits)
    assert info.value.reason == reason


def test_prompt_wrong_type_is_malformed() -> None:
    wire = msgpack.unpackb(encode_prompt(make_prompt()))
    wire["n"] = "8"
    with pytest.raises(ValidationError) as info:
        decode_prompt(msgpack.packb(wire))
    assert info.value.reason == "malformed"


# ---------------------------------------------------------------------------------------------
# the error type and the limits


def test_validation_error_is_a_value_error_that_pickles() -> None:
    err = ValidationError("finish", "samples[0].finish 'eos' unknown")
    assert isinstance(err, ValueError)
    assert str(err) == "finish: samples[0].finish 'eos' unknown"
    back = pickle.loads(pickle.dumps(err))
    assert (back.reason, back.message) == ("finish", err.message)


def test_a_sample_past_the_models_positions_is_too_large() -> None:
    """Prompt and response of a sample together: the positions the trainer runs it at."""
    fits = make_group(prompt_ids=np.arange(7, dtype=np.int32), samples=[make_sample(n=5)])
    validate_group(fits, limits=Limits(max_positions=12))
    over = make_group(prompt_ids=np.arange(7, dtype=np.int32), samples=[make_sample(n=6)])
    with pytest.raises(
        ValidationError, match=r"samples\[0\]\.response_ids: 7 \+ 6 tokens pass 12"
    ) as info:
        validate_group(over, limits=Limits(max_positions=12))
    assert info.value.reason == "too_large"


def test_limits_must_be_positive() -> None:
    with pytest.raises(ValueError, match="max_samples"):
        Limits(max_samples=0)


@pytest.mark.parametrize(
    ("group", "kwargs", "reason"),
    [case[1:] for case in BAD_GROUPS],
    ids=[case[0] for case in BAD_GROUPS],
)
def test_bad_group_checked_sample_by_sample_is_rejected_alike(
    monkeypatch: pytest.MonkeyPatch, group: TrajectoryGroup, kwargs: dict[str, Any], reason: str
) -> None:
    # Long groups are checked on each sample's own arrays; every group here takes that path.
    monkeypatch.setattr(validate, "CONCAT_MAX_TOKENS", 0)
    if group.schema != 3:  # the bulk layout is checked joined, whatever the length
        group = dataclasses.replace(group, schema=1)
    assert reason_of(encode_group(group), **kwargs) == reason


def test_decode_groups_decodes_a_batch_as_each_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    plain = [make_group([make_sample(n=n, version=3 + n % 2)]) for n in (5, 0, 2)]
    masked = make_group([make_sample(loss_mask=np.array([1, 0, 1, 1, 1], np.uint8))])
    datas = [
        *(encode_group(g) for g in plain),
        encode_group(dataclasses.replace(plain[0], schema=1)),  # as older workers wrote
        encode_group(masked),  # optional arrays: decoded alone
        encode_group(make_group([make_sample(logprobs=np.array([0.5] * 5, np.float32))])),
        b"\xc1",
    ]
    alone: list[Any] = []
    for data in datas:
        try:
            alone.append(decode_group(data, current_version=4))
        except ValidationError as exc:
            alone.append(exc)
    together = decode_groups(datas, current_version=4)
    assert [type(x) for x in together] == [type(x) for x in alone]
    groups = [g for g in together if isinstance(g, TrajectoryGroup)]
    errors = [e.reason for e in together if isinstance(e, ValidationError)]
    assert errors == ["logprob_positive", "malformed"]
    assert [encode_group(g) for g in groups] == [encode_group(g) for g in alone[:5]]

    # The common shape takes the batch path alone: no entry decoded on its own.
    def alone_not_wanted(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("decoded on its own")

    monkeypatch.setattr(batch, "decode_group", alone_not_wanted)
    out = [g for g in decode_groups(datas[:3], current_version=4) if type(g) is TrajectoryGroup]
    assert [len(g.samples[0].response_ids) for g in out] == [5, 0, 2]
    # A version ahead of the trainer in one of them sends the batch to the exact path.
    with pytest.raises(AssertionError, match="on its own"):
        decode_groups(datas[:3], current_version=3)


def test_the_bulk_layout_writes_the_groups_fields_first_in_their_declared_order() -> None:
    # The encoder writes them out by name: a field added to TrajectoryGroup must be added there.
    names = ["schema", *(f.name for f in dataclasses.fields(TrajectoryGroup))]
    names = list(dict.fromkeys(n for n in names if n != "samples"))
    bulk = msgpack.unpackb(encode_group(make_group()))
    per_sample = msgpack.unpackb(encode_group(make_group(schema=1)))  # the generic writer's
    assert list(bulk)[: len(names)] == names
    assert all(bulk[n] == per_sample[n] for n in names if n != "schema")
