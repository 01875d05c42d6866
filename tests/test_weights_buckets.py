"""Flat bucket packing: layout, round trip over buckets, checksum; and the config's contract."""

from __future__ import annotations

import itertools
import subprocess
import sys

import pydantic
import pytest
import torch

from asyncrl.weights.buckets import (
    ALIGN,
    FlatBuffer,
    Header,
    Layout,
    Packer,
    bucket_ranges,
    checksum,
    checksum_tensors,
    wrap64,
)
from asyncrl.weights.config import BroadcastWeightsConfig, StoreWeightsConfig


def mixed() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "z.fp32": torch.randn(37, 5, generator=g),
        "a.bf16": torch.randn(3, 7, generator=g).bfloat16(),  # 42 bytes: padding follows
        "m.int64": torch.randint(-(2**62), 2**62, (11,), generator=g),
        "b.bool": torch.rand(9, generator=g) > 0.5,
        "c.scalar": torch.tensor(3.25),
        "d.empty": torch.empty(0, 4),
        "e.fp16": torch.randn(5, generator=g).half(),
    }


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    )


def test_layout_order_is_by_name_and_offsets_are_aligned() -> None:
    tensors = mixed()
    layout = Layout.of(tensors.items())
    assert [s.name for s in layout.specs] == sorted(tensors)
    assert Layout.of(reversed(list(tensors.items()))) == layout  # input order does not matter
    assert all(s.offset % ALIGN == 0 for s in layout.specs)
    assert layout.total_bytes % ALIGN == 0
    assert Layout.from_bytes(layout.to_bytes()) == layout


def test_round_trip_over_buckets_with_mixed_dtypes() -> None:
    tensors = mixed()
    sent = FlatBuffer(Layout.of(tensors.items()), torch.device("cpu"))
    sent.pack(tensors.items())
    # What a receiver does: layout from its JSON, buckets copied one by one into a fresh buffer.
    layout = Layout.from_bytes(sent.layout.to_bytes())
    flat = torch.empty(layout.total_bytes, dtype=torch.uint8)
    ranges = bucket_ranges(layout.total_bytes, bucket_bytes=100)  # cuts through tensors
    assert ranges[0][0] == 0 and ranges[-1][1] == layout.total_bytes
    assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges))
    for start, end in ranges:
        flat[start:end] = sent.flat[start:end]
    received = layout.views(flat)
    assert list(received) == sorted(tensors)
    for name, tensor in tensors.items():
        assert same_bits(received[name], tensor), name
    assert checksum(flat) == checksum(sent.flat)


@pytest.mark.parametrize("narrow_to", [None, torch.bfloat16])
def test_packing_bucket_by_bucket_equals_packing_at_once(narrow_to: torch.dtype | None) -> None:
    tensors = mixed()
    layout = Layout.of(tensors.items(), narrow_to)
    whole = FlatBuffer(layout, torch.device("cpu"))
    whole.pack(tensors.items())
    piecewise = FlatBuffer(layout, torch.device("cpu"))
    packer = Packer(piecewise, reversed(list(tensors.items())))
    filled = 0
    for _, end in bucket_ranges(layout.total_bytes, bucket_bytes=ALIGN):  # cuts through tensors
        packer.through(end)
        # Everything below `end` is packed, nothing at or above it yet (but zero padding).
        assert torch.equal(piecewise.flat[:end], whole.flat[:end])
        assert not piecewise.flat[end:].any()
        filled = end
    assert filled == layout.total_bytes
    packer.through(layout.total_bytes)  # once done, a call more changes nothing
    assert torch.equal(piecewise.flat, whole.flat)


def test_checksum_detects_any_flipped_byte() -> None:
    buffer = FlatBuffer(Layout.of(mixed().items()), torch.device("cpu"))
    buffer.pack(mixed().items())
    reference = checksum(buffer.flat)
    for spec in buffer.layout.specs:
        for pos in {spec.offset, spec.offset + spec.nbytes - 1} if spec.nbytes else ():
            for bit in (0, 7):
                flipped = buffer.flat.clone()
                flipped[pos] ^= 1 << bit
                assert checksum(flipped) != reference, (spec.name, pos, bit)


def test_checksum_of_loose_tensors_equals_that_of_the_packed_buffer() -> None:
    tensors = mixed()
    buffer = FlatBuffer(Layout.of(tensors.items()), torch.device("cpu"))
    buffer.pack(tensors.items())
    assert checksum_tensors(reversed(list(tensors.values()))) == checksum(buffer.flat)
    # A view at an odd byte offset must give the same answer as a fresh tensor.
    base = torch.arange(100, dtype=torch.uint8)
    assert checksum_tensors([base[3:50]]) == checksum_tensors([base[3:50].clone()])


def test_checksum_wraps_like_int64() -> None:
    words = torch.tensor([2**62, 2**62, 2**62, 5], dtype=torch.int64)
    expected = (3 * 2**62 + 5 + 2**63) % 2**64 - 2**63
    assert checksum(words.view(torch.uint8)) == expected == checksum_tensors([words])


def test_bucket_checksums_add_up_to_the_buffer_s_and_see_a_flip_in_any_bucket() -> None:
    words = torch.randint(-(2**62), 2**62, (1000,), dtype=torch.int64)
    flat = words.view(torch.uint8)
    ranges = bucket_ranges(flat.numel(), 8 * 64)
    assert wrap64(sum(checksum(flat[s:e]) for s, e in ranges)) == checksum(flat)
    for start, _ in ranges:
        flipped = flat.clone()
        flipped[start] ^= 1
        assert wrap64(sum(checksum(flipped[s:e]) for s, e in ranges)) != checksum(flat)


def test_a_narrowed_layout_casts_wider_floats_only() -> None:
    tensors = mixed()
    layout = Layout.of(tensors.items(), narrow_to=torch.bfloat16)
    dtypes = {s.name: s.dtype for s in layout.specs}
    assert dtypes["z.fp32"] == dtypes["c.scalar"] == dtypes["a.bf16"] == torch.bfloat16
    assert dtypes["e.fp16"] == torch.float16  # as narrow already
    assert (dtypes["m.int64"], dtypes["b.bool"]) == (torch.int64, torch.bool)
    assert layout.total_bytes < Layout.of(tensors.items()).total_bytes
    buffer = FlatBuffer(layout, torch.device("cpu"))
    buffer.pack(tensors.items())
    assert same_bits(buffer.tensors["z.fp32"], tensors["z.fp32"].bfloat16())
    assert same_bits(buffer.tensors["m.int64"], tensors["m.int64"])
    assert Layout.from_bytes(layout.to_bytes()) == layout


def test_header_round_trip_and_foreign_data_rejected() -> None:
    header = Header(version=7, total_bytes=1000, bucket_bytes=300, layout_bytes=42)
    assert Header.from_tensor(header.to_tensor(torch.device("cpu"))) == header
    assert header.n_buckets == 4
    with pytest.raises(ValueError, match="header"):
        Header.from_tensor(Header.empty(torch.device("cpu")))


def test_duplicate_names_rejected() -> None:
    with pytest.raises(ValueError, match="twice"):
        Layout.of([("w", torch.zeros(2)), ("w", torch.zeros(2))])


def test_config_defaults_and_unknown_keys() -> None:
    cfg = BroadcastWeightsConfig()
    store = StoreWeightsConfig()
    assert (cfg.type, cfg.bucket_mb, cfg.sync_timeout_s, store.keep_last) == (
        "broadcast",
        64,
        30,
        3,
    )
    assert (store.store_dir, cfg.master_addr, cfg.master_port, cfg.backend) == (
        None,
        "127.0.0.1",
        0,
        "auto",
    )
    for member in (BroadcastWeightsConfig, StoreWeightsConfig):
        assert all(f.description for f in member.model_fields.values())
    with pytest.raises(pydantic.ValidationError):
        BroadcastWeightsConfig(bucket_size=1)  # type: ignore[call-arg]
    with pytest.raises(pydantic.ValidationError):
        BroadcastWeightsConfig(backend="mpi")  # type: ignore[arg-type]


def test_config_imports_no_torch() -> None:
    code = "import sys, asyncrl.weights; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)
