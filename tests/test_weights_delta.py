"""Sparse delta sync's math (`asyncrl.weights.delta`): hand-worked encodings, and bit-exact
reconstruction — a receiver's weights after N deltas are the weights of a full sync of N."""

from __future__ import annotations

import pytest
import torch

from asyncrl.weights.buckets import FlatBuffer, Layout, checksum
from asyncrl.weights.delta import (
    Delta,
    DeltaRefused,
    DeltaSource,
    Encoding,
    Held,
    apply,
    encode,
    encoded_sizes,
    gaps_size,
    word_dtype,
)
from asyncrl.weights.fields import DeltaFields


def test_encoded_sizes_hand_worked() -> None:
    # 1024 words of 2 bytes, 3 changed: pairs = one block's count 8 + indices 8 + values 8;
    # mask 128 + 8; raw 2048.
    assert encoded_sizes(1024, 3, 2) == {Encoding.PAIRS: 24, Encoding.MASK: 136, Encoding.RAW: 2048}
    # 400 of 1024 fp32 words changed: pairs 8 + 800 + 1600 > mask 128 + 1600.
    assert encoded_sizes(1024, 400, 4) == {
        Encoding.PAIRS: 2408,
        Encoding.MASK: 1728,
        Encoding.RAW: 4096,
    }
    # 3 blocks of 65536 words: three counts, padded to 16 bytes.
    assert encoded_sizes(3 << 16, 1, 2)[Encoding.PAIRS] == 16 + 8 + 8


def test_word_is_the_narrowest_float() -> None:
    bf16 = Layout.of([("a", torch.zeros(3)), ("b", torch.zeros(2, dtype=torch.bfloat16))])
    fp32 = Layout.of([("a", torch.zeros(3)), ("n", torch.zeros(2, dtype=torch.int64))])
    ints = Layout.of([("n", torch.zeros(2, dtype=torch.int64))])
    assert (word_dtype(bf16), word_dtype(fp32), word_dtype(ints)) == (
        torch.int16,
        torch.int32,
        torch.int32,
    )


def _flat(words: list[int], dtype: torch.dtype) -> torch.Tensor:
    return torch.tensor(words, dtype=dtype).view(torch.uint8)


def test_each_bucket_picks_its_smallest_encoding() -> None:
    # Four buckets of 1024 bytes = 512 int16 words: one change, 40 changes, none, all.
    old = torch.zeros(2048, dtype=torch.int16)
    new = old.clone()
    new[5] = 7  # pairs 8 + 8 + 8 = 24 < mask 64 + 8; = gaps 8 + 8 + 8: the first wins
    new[512 : 512 + 40] = 1000  # mask 64 + 80 = 144 < pairs 8 + 80 + 80 = gaps 8 + 80 + 80
    new[1536:] = 3  # raw 1024 < gaps 8 + 512 + 512 < mask 64 + 1024
    d = encode(old.view(torch.uint8), new.view(torch.uint8), torch.int16, (4, 5), 1024)
    assert d is not None
    assert d.table.tolist() == [[1, 24, 1], [2, 144, 40], [0, 0, 0], [3, 1024, 512]]
    assert d.payload[:4].view(torch.int32).tolist() == [1]  # one change in block 0
    assert d.payload[8:10].view(torch.int16).tolist() == [5]  # at word 5
    assert d.payload[16:18].view(torch.int16).tolist() == [7]  # now 7
    bits = d.payload[24 : 24 + 64].tolist()
    assert bits[:6] == [0xFF] * 5 + [0] and sum(bits) == 5 * 0xFF  # words 0..39, LSB first
    assert (d.version, d.base, d.checksum) == (5, 4, checksum(new.view(torch.uint8)))
    flat = old.clone().view(torch.uint8)
    apply(flat, d, 1024)
    assert torch.equal(flat.view(torch.int16), new)


def test_pairs_indices_cross_blocks_of_65536_words() -> None:
    old = torch.zeros(3 << 16, dtype=torch.int16)
    new = old.clone()
    at = [0, 65535, 65536, 131071, 196607]  # both ends of every block
    # Wide values: gaps would cost 8 + 8 + 16 (three long gaps) + 8 + 16 = 56 > 48.
    new[at] = torch.tensor([1000, 2000, 3000, 4000, 5000], dtype=torch.int16)
    d = encode(old.view(torch.uint8), new.view(torch.uint8), torch.int16, (0, 1), 6 << 16)
    assert d is not None
    assert d.table.tolist() == [[1, 16 + 16 + 16, 5]]
    assert d.payload[:12].view(torch.int32).tolist() == [2, 2, 1]
    flat = old.clone().view(torch.uint8)
    apply(flat, d, 6 << 16)
    assert torch.equal(flat.view(torch.int16), new)


def test_gaps_hand_worked() -> None:
    # 512 words held as 3 * i; 41 changes: every other word of 0..78 by +1, except word 10
    # by -127 (the widest step an int8 holds) and word 14 by +128 (wide: sent whole); then
    # word 500, 421 words after word 78 (a long gap).
    old = torch.arange(512, dtype=torch.int16) * 3
    new = old.clone()
    at = [*range(0, 80, 2), 500]
    new[at] += 1
    new[10] -= 128
    new[14] += 127
    gaps, pairs, mask = 8 + 48 + 8 + 48 + 8, 8 + 88 + 88, 64 + 88
    assert gaps_size(41, 1, 1, 2) == gaps
    assert encoded_sizes(512, 41, 2) == {
        Encoding.PAIRS: pairs,
        Encoding.MASK: mask,
        Encoding.RAW: 1024,
    }
    d = encode(old.view(torch.uint8), new.view(torch.uint8), torch.int16, (0, 1), 1024)
    assert d is not None
    assert d.table.tolist() == [[int(Encoding.GAPS), gaps, 41]]
    p = d.payload
    assert p[:8].view(torch.int32).tolist() == [1, 1]  # one long gap, one wide value
    assert p[8:49].tolist() == [0] + [1] * 39 + [255]  # word 0, then one skipped each time
    assert p[56:60].view(torch.int32).tolist() == [421]
    assert p[64:105].view(torch.int8).tolist() == [1] * 5 + [-127, 1, -128] + [1] * 33
    assert p[112:114].view(torch.int16).tolist() == [3 * 14 + 128]
    flat = old.clone().view(torch.uint8)
    apply(flat, d, 1024)
    assert torch.equal(flat.view(torch.int16), new)


def test_malformed_gaps_raise_value_error() -> None:
    old = torch.zeros(256, dtype=torch.int16)
    new = old.clone()
    new[:40:2] = 1
    d = encode(old.view(torch.uint8), new.view(torch.uint8), torch.int16, (0, 1), 512)
    assert d is not None and d.table[0, 0] == Encoding.GAPS

    def broken(at: int, byte: int) -> Delta:
        payload = d.payload.clone()
        payload[at] = byte
        return Delta(1, 0, 0, torch.int16, d.table, payload)

    flat = old.clone().view(torch.uint8)
    short = Delta(1, 0, 0, torch.int16, torch.tensor([[int(Encoding.GAPS), 2, 1]]), d.payload[:2])
    with pytest.raises(ValueError, match="no head"):
        apply(flat, short, 512)
    with pytest.raises(ValueError, match="not"):
        apply(flat, broken(0, 3), 512)  # three long gaps said: the size disagrees
    with pytest.raises(ValueError, match="escapes"):
        apply(flat, broken(8, 255), 512)  # a long gap code with no long gap sent
    with pytest.raises(ValueError, match="beyond"):
        apply(flat, broken(9, 254), 512)  # word 255 + 36 of 256
    with pytest.raises(ValueError, match="escapes"):
        apply(flat, broken(32, 0x80), 512)  # a wide step code with no wide value sent


def _model(dtype: torch.dtype, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "emb": torch.randn(300, 64, generator=g),
        "w": torch.randn(64, 64, generator=g),
        "bias": torch.randn(63, generator=g),
        "count": torch.zeros(3, dtype=torch.int64),
        "mask": torch.zeros(5, dtype=torch.bool),
    }


def _step(params: dict[str, torch.Tensor], lr: float, g: torch.Generator) -> None:
    """An update that moves a few embedding rows by `lr` (relative), every other weight by
    1e-6 relative (which rounds away in bf16, not in fp32), and the counter and mask."""
    rows = torch.randint(0, 300, (12,), generator=g)
    params["emb"][rows] *= 1 + lr * torch.randn(12, 64, generator=g)
    params["w"] *= 1 + 1e-6 * torch.randn(64, 64, generator=g)
    params["count"] += 1
    params["mask"][0] = ~params["mask"][0]


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


# On CUDA the codec runs torch's own ops (numpy's on CPU): tools/gpu_check.sh runs that case.
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA)])
@pytest.mark.parametrize("engine", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("lr", [1e-6, 1e-2])
def test_n_deltas_equal_a_full_sync_bit_for_bit(
    engine: torch.dtype, lr: float, device: str
) -> None:
    params = _model(torch.float32)
    g = torch.Generator().manual_seed(1)
    narrow = engine if engine != torch.float32 else None
    source = DeltaSource(DeltaFields(enabled=True, anchor_every=100, max_fraction=1.0))
    held = Held()
    sent_full, kinds = 0, set()
    for version in range(8):
        buf = FlatBuffer(Layout.of(params.items(), narrow), torch.device(device))
        buf.pack(params.items())
        delta = source.encode(buf.flat, buf.layout, version, anchor=False)
        if delta is None:
            held.anchor(buf.flat, buf.layout, version)
            sent_full += 1
        else:
            assert delta.nbytes < buf.layout.total_bytes
            kinds |= {Encoding(k) for k in delta.table[:, 0].tolist()}
            got = held.apply(delta, buf.layout)
            # What a full sync of this version would hand over, bit for bit.
            assert torch.equal(got, buf.flat)
        source.sent(buf.flat, buf.layout, version, delta)
        _step(params, lr, g)
    assert sent_full == 1
    # Hundreds of small steps go as gaps (some wide at 1e-2), a handful as pairs or gaps.
    assert Encoding.GAPS in kinds and kinds <= {Encoding.PAIRS, Encoding.GAPS}


def test_the_delta_stops_paying_then_full() -> None:
    a = torch.randn(4096)
    buf = FlatBuffer(Layout.of([("a", a)]), torch.device("cpu"))
    buf.pack([("a", a)])
    source = DeltaSource(DeltaFields(enabled=True, max_fraction=0.5))
    source.sent(buf.flat, buf.layout, 0, None)
    buf.pack([("a", a + 1)])  # every word changes
    assert source.encode(buf.flat, buf.layout, 1, anchor=False) is None
    assert source.fallbacks == 1


def test_anchor_every_k_and_on_request() -> None:
    a = torch.randn(1024)
    buf = FlatBuffer(Layout.of([("a", a)]), torch.device("cpu"))
    source = DeltaSource(DeltaFields(enabled=True, anchor_every=3))
    kinds = []
    buf.pack([("a", a)])
    for v in range(7):
        buf.flat[:8] = v  # one word changes per version: a delta always pays
        d = source.encode(buf.flat, buf.layout, v, anchor=(v == 5))
        kinds.append("d" if d is not None else "A")
        source.sent(buf.flat, buf.layout, v, d)
    # The first; after two deltas (every 3rd); asked for; then counting from there.
    assert "".join(kinds) == "AddAdAd"


def test_a_delta_on_the_wrong_base_is_refused_and_nothing_runs_on_it() -> None:
    a = torch.randn(2048)
    buf = FlatBuffer(Layout.of([("a", a)]), torch.device("cpu"))
    buf.pack([("a", a)])
    held = Held()
    held.anchor(buf.flat, buf.layout, 3)
    new = buf.flat.clone()
    new[:64] += 1
    delta = encode(buf.flat, new, torch.int32, (4, 5))  # on version 4; this holds 3
    assert delta is not None
    with pytest.raises(DeltaRefused, match="holds 3"):
        held.apply(delta, buf.layout)
    assert held.version == 3 and held.flat is not None  # untouched, still usable
    # The right base number but other bytes (a corrupted base): the checksum refuses it.
    lying = Delta(5, 3, delta.checksum, delta.word, delta.table, delta.payload)
    held.flat[100] ^= 1
    with pytest.raises(DeltaRefused, match="checksum"):
        held.apply(lying, buf.layout)
    assert held.flat is None  # it takes an anchor next


def test_malformed_tables_raise_value_error() -> None:
    flat = torch.zeros(128, dtype=torch.uint8)
    bad = Delta(
        1, 0, 0, torch.int16, torch.tensor([[1, 24, 99]]), torch.zeros(24, dtype=torch.uint8)
    )
    with pytest.raises(ValueError):
        apply(flat, bad, 128)
    # One change in a bucket of 64 words, at index 1000.
    head = torch.tensor([1, 0], dtype=torch.int32).view(torch.uint8)
    index = torch.tensor([1000, 0, 0, 0], dtype=torch.int16).view(torch.uint8)
    payload = torch.cat([head, index, torch.zeros(8, dtype=torch.uint8)])
    far = Delta(1, 0, 0, torch.int16, torch.tensor([[1, 24, 1]]), payload)
    with pytest.raises(ValueError, match="beyond"):
        apply(flat, far, 128)
    # Block counts that do not add up to the changes the table says.
    lying = Delta(1, 0, 0, torch.int16, torch.tensor([[1, 24, 2]]), payload)
    with pytest.raises(ValueError):
        apply(flat, lying, 128)
