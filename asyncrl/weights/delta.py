"""Sparse delta sync: only the words of the flat buffer that changed since the receivers' version.

A version is the flat buffer of `buckets` — already in the engine's dtype, so an update that
rounds away in bf16 changes nothing here. It is compared with the last version every receiver
holds (the base) as machine words of the narrowest floating dtype in the layout (2 bytes for a
bf16 engine, 4 for fp32): a word is one element, and a changed byte anywhere — an int counter,
a bool mask — sends its whole word, so the result is exact for every dtype. Each bucket of
`BUCKET_BYTES` is encoded in whichever of these is smallest:

    SAME   nothing changed: no payload
    PAIRS  (index, value) pairs: the number of changes in each block of 65 536 words (uint32),
           the indices' low 16 bits (uint16, ascending), then the new words
    MASK   one bit per word (little-endian bit order), then the new words
    RAW    the bucket as it is
    GAPS   the number of long gaps and of wide values (int32 each); each change's distance from
           the one before less one (uint8; 255: a long gap, then in order as int32); each new
           word minus the held one (int8; -128: a wide value, then in order as words)

GAPS is PAIRS at about 2 bytes a change where changes are dense and small (a step of a few
ulps): a difference from the held word is exact since the receiver holds that word — and the
checksum guards the result in any case. Its size depends on the data, so the encoder computes
it; the others' follows from the counts. Each section is padded to 8 bytes so that the
receiver views it in place. The table
int64[buckets, 3] holds (encoding, payload bytes, changed words) per bucket; the payload is the
sections in bucket order. A delta says which version it applies to (its base) and carries the
checksum (`buckets.checksum`) of the flat buffer it produces: a receiver that holds another
base, or whose result sums differently, refuses it and never hands the weights over — it takes
an anchor (a full version) instead, or pulls the versions it lacks (`versions.read_to`).

The encoder (`DeltaSource`, trainer side) keeps a copy of the base, so the trainer's host holds
one more copy of the weights in the engine's dtype; each receiver (`Held`) keeps one too, since
the engine may keep the tensors it is handed. Everything here runs where the buffers live (CPU
or accelerator).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum
from typing import TYPE_CHECKING

import numpy as np
import torch

from asyncrl.weights.buckets import FlatBuffer, Layout, bucket_ranges, checksum

if TYPE_CHECKING:
    from asyncrl.weights.fields import DeltaFields

BUCKET_BYTES = 16 << 20
"""Bytes per encoded bucket: small enough that a local burst of changes costs one bucket's
raw size at most, large enough that the table stays negligible."""

_WORDS = {2: torch.int16, 4: torch.int32, 8: torch.int64}
_SHIFTS = torch.arange(8, dtype=torch.uint8)
_BLOCK = 1 << 16  # words per block of PAIRS: an index within one takes 16 bits
_LONG = 255  # a GAPS gap code: the gap is in the long gaps
_WIDE = -128  # a GAPS step code: the new word is in the wide values


class Encoding(IntEnum):
    SAME = 0
    PAIRS = 1
    MASK = 2
    RAW = 3
    GAPS = 4


def word_dtype(layout: Layout) -> torch.dtype:
    """The word a change is counted in: the narrowest floating element of the layout (2 to 8
    bytes; 4 when there is none)."""
    sizes = [s.dtype.itemsize for s in layout.specs if s.dtype.is_floating_point]
    return _WORDS[min(max(min(sizes, default=4), 2), 8)]


def _pad8(n: int) -> int:
    return -(-n // 8) * 8


def _bytes(t: torch.Tensor, size: int) -> torch.Tensor:
    if t.numel() == 0:  # numpy's empty selections come with strides torch will not view
        return t.new_zeros(size, dtype=torch.uint8)
    raw = t.contiguous().view(torch.uint8).reshape(-1)
    return torch.cat([raw, raw.new_zeros(size - raw.numel())]) if raw.numel() < size else raw


def encoded_sizes(words: int, changed: int, itemsize: int) -> dict[Encoding, int]:
    """Payload bytes of a bucket of `words` words, `changed` of them changed, per encoding."""
    values = _pad8(changed * itemsize)
    return {
        Encoding.PAIRS: _pad8(-(-words // _BLOCK) * 4) + _pad8(changed * 2) + values,
        Encoding.MASK: _pad8(words // 8) + values,
        Encoding.RAW: words * itemsize,
    }


def gaps_size(changed: int, long_gaps: int, wide: int, itemsize: int) -> int:
    """Payload bytes of a GAPS bucket of `changed` changes, `long_gaps` of them 256 words or
    more after the one before, `wide` of them more than 127 from the held word."""
    return 8 + 2 * _pad8(changed) + _pad8(long_gaps * 4) + _pad8(wide * itemsize)


# The few operations that differ in speed by 3-10x between torch and numpy on CPU (boolean
# indexing, nonzero, bit packing); on an accelerator torch's own run where the buffers are.


def _changed(old: torch.Tensor, new: torch.Tensor) -> tuple[torch.Tensor, int]:
    changed = old != new
    return changed, int(torch.count_nonzero(changed))


def _select(words: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    if words.device.type == "cpu":
        return torch.from_numpy(words.numpy()[mask.numpy()])
    return words[mask]


def _where(mask: torch.Tensor) -> torch.Tensor:
    if mask.device.type == "cpu":
        return torch.from_numpy(np.flatnonzero(mask.numpy()))
    return mask.nonzero().reshape(-1)


def _pack(mask: torch.Tensor) -> torch.Tensor:
    if mask.device.type == "cpu":
        return torch.from_numpy(np.packbits(mask.numpy(), bitorder="little"))
    shifts = _SHIFTS.to(mask.device)
    return (mask.view(-1, 8).to(torch.uint8) << shifts).sum(1, dtype=torch.uint8)


def _unpack(bits: torch.Tensor) -> torch.Tensor:
    if bits.device.type == "cpu":
        return torch.from_numpy(np.unpackbits(bits.numpy(), bitorder="little").view(np.bool_))
    return ((bits.unsqueeze(1) >> _SHIFTS.to(bits.device)) & 1).bool().reshape(-1)


def _take(words: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    if words.device.type == "cpu":
        return torch.from_numpy(words.numpy()[index.numpy()])
    return words[index]


def _put(words: torch.Tensor, index: torch.Tensor, values: torch.Tensor) -> None:
    if words.device.type == "cpu":
        words.numpy()[index.numpy()] = values.numpy()
    else:
        words[index] = values


def _scatter(words: torch.Tensor, mask: torch.Tensor, values: torch.Tensor) -> None:
    if words.device.type == "cpu":
        words.numpy()[mask.numpy()] = values.numpy()
    else:
        words.masked_scatter_(mask, values)


@dataclass(frozen=True)
class Delta:
    """The change from version `base` to `version`; applied to `base`'s flat buffer it gives
    one whose checksum is `checksum`."""

    version: int
    base: int
    checksum: int
    word: torch.dtype
    table: torch.Tensor
    """int64[buckets, 3]: (Encoding, payload bytes, changed words) of each bucket of
    BUCKET_BYTES."""
    payload: torch.Tensor
    """uint8: the buckets' sections, in order."""

    @property
    def nbytes(self) -> int:
        return self.table.numel() * 8 + self.payload.numel()


def _encode_bucket(
    old: torch.Tensor, new: torch.Tensor
) -> tuple[Encoding, int, list[torch.Tensor]]:
    """(encoding, changed words, sections) of one bucket of words."""
    changed, n = _changed(old, new)
    if n == 0:
        return Encoding.SAME, 0, []
    itemsize = new.element_size()
    sizes = encoded_sizes(new.numel(), n, itemsize)
    gaps: list[torch.Tensor] = []
    if gaps_size(n, 0, 0, itemsize) < min(sizes.values()):
        gaps = _gaps(old, new, _where(changed))
        sizes[Encoding.GAPS] = sum(x.numel() for x in gaps)
    best = min(sizes, key=lambda e: sizes[e])
    if best is Encoding.GAPS:
        return best, n, gaps
    if best is Encoding.RAW:
        return best, n, [_bytes(new, sizes[best])]
    values = _bytes(_select(new, changed), _pad8(n * itemsize))
    if best is Encoding.MASK:
        return best, n, [_bytes(_pack(changed), _pad8(new.numel() // 8)), values]
    index = _where(changed)
    blocks = -(-new.numel() // _BLOCK)
    bounds = torch.arange(blocks + 1, device=index.device) * _BLOCK
    counts = torch.searchsorted(index, bounds).diff().to(torch.int32)  # index is ascending
    low = (index & (_BLOCK - 1)).to(torch.int16)  # the low 16 bits: 65535 reads as -1
    return best, n, [_bytes(counts, _pad8(blocks * 4)), _bytes(low, _pad8(n * 2)), values]


def _gaps(old: torch.Tensor, new: torch.Tensor, index: torch.Tensor) -> list[torch.Tensor]:
    """The sections of a GAPS bucket whose changed words are at `index` (ascending)."""
    gap = torch.diff(index, prepend=index.new_full((1,), -1)) - 1
    long = gap >= _LONG
    codes = gap.clamp(max=_LONG).to(torch.uint8)
    far = _select(gap, long).to(torch.int32)
    values = _take(new, index)
    step = values.long() - _take(old, index).long()
    wide = (step < -127) | (step > 127)
    steps = step.masked_fill(wide, _WIDE).to(torch.int8)
    full = _select(values, wide)
    head = torch.tensor([far.numel(), full.numel()], dtype=torch.int32, device=index.device)
    n = index.numel()
    return [
        _bytes(head, 8),
        _bytes(codes, _pad8(n)),
        _bytes(far, _pad8(far.numel() * 4)),
        _bytes(steps, _pad8(n)),
        _bytes(full, _pad8(full.numel() * full.element_size())),
    ]


def _apply_gaps(words: torch.Tensor, part: torch.Tensor, n: int) -> None:
    """Apply a GAPS bucket of `n` changes to `words`, checked."""
    if part.numel() < 8:
        raise ValueError(f"gaps bucket of {part.numel()} bytes has no head")
    far_n, wide_n = part[:8].view(torch.int32).tolist()
    itemsize = words.element_size()
    if min(far_n, wide_n) < 0 or gaps_size(n, far_n, wide_n, itemsize) != part.numel():
        raise ValueError(f"gaps bucket of {n} changes is not {part.numel()} bytes")
    at = 8
    gap = part[at : at + n].long()
    at += _pad8(n)
    far = part[at : at + far_n * 4].view(torch.int32).long()
    at += _pad8(far_n * 4)
    steps = part[at : at + n].view(torch.int8)
    full = part[at + _pad8(n) :][: wide_n * itemsize].view(words.dtype)
    long, wide = gap == _LONG, steps == _WIDE
    if int(torch.count_nonzero(long)) != far_n or int(torch.count_nonzero(wide)) != wide_n:
        raise ValueError("gaps bucket whose escapes do not count its long gaps or wide values")
    if far_n and int(far.min()) < _LONG:
        raise ValueError("gaps bucket with a short long gap")
    _scatter(gap, long, far)
    index = torch.cumsum(gap + 1, 0) - 1
    if n and int(index[-1]) >= words.numel():
        raise ValueError("delta index beyond its bucket")
    values = (_take(words, index).long() + steps.long()).to(words.dtype)
    _scatter(values, wide, full)
    _put(words, index, values)


def encode(
    base: torch.Tensor,
    new: torch.Tensor,
    word: torch.dtype,
    versions: tuple[int, int],
    bucket_bytes: int = BUCKET_BYTES,
    limit: int | None = None,
) -> Delta | None:
    """The delta from flat buffer `base` to `new` (same size), as `versions` = (base, new);
    None as soon as its payload would exceed `limit` bytes (the rest is not encoded)."""
    if base.numel() != new.numel():
        raise ValueError("a delta needs two buffers of one layout")
    rows, parts, size = [], [], 0
    for s, e in bucket_ranges(new.numel(), bucket_bytes):
        kind, n, sections = _encode_bucket(base[s:e].view(word), new[s:e].view(word))
        rows.append([int(kind), sum(x.numel() for x in sections), n])
        parts += sections
        size += rows[-1][1]
        if limit is not None and size > limit:
            return None
    payload = torch.cat(parts) if parts else new.new_zeros(0)
    table = torch.tensor(rows, dtype=torch.int64).reshape(-1, 3)
    return Delta(versions[1], versions[0], checksum(new), word, table, payload)


def apply(flat: torch.Tensor, delta: Delta, bucket_bytes: int = BUCKET_BYTES) -> None:
    """Apply `delta` to `flat` (its base's buffer) in place. A malformed delta raises
    ValueError; comparing the checksum is the caller's part."""
    ranges = bucket_ranges(flat.numel(), bucket_bytes)
    rows = delta.table.tolist()
    if len(rows) != len(ranges) or sum(r[1] for r in rows) != delta.payload.numel():
        raise ValueError("delta table does not match the buffer")
    at = 0
    for (s, e), (kind, size, n) in zip(ranges, rows, strict=True):
        part, at = delta.payload[at : at + size], at + size
        words = flat[s:e].view(delta.word)
        if kind == Encoding.SAME:
            continue
        if kind == Encoding.GAPS:
            _apply_gaps(words, part, n)
            continue
        expected = encoded_sizes(words.numel(), n, delta.word.itemsize).get(Encoding(kind))
        if expected != size:
            raise ValueError(f"bucket of encoding {kind} and {n} changes is not {size} bytes")
        if kind == Encoding.RAW:
            words.copy_(part.view(delta.word))
            continue
        head = size - _pad8(n * delta.word.itemsize)
        values = part[head:].view(delta.word)[:n]
        if kind == Encoding.PAIRS:
            _put(words, _pairs_index(part[:head], words.numel(), n), values)
        else:
            mask = _unpack(part[: words.numel() // 8])
            if int(torch.count_nonzero(mask)) != n:
                raise ValueError("mask bucket whose bits do not count its changes")
            _scatter(words, mask, values)


def _pairs_index(head: torch.Tensor, words: int, n: int) -> torch.Tensor:
    """The word indices of a PAIRS bucket of `words` words and `n` changes, checked."""
    blocks = -(-words // _BLOCK)
    counts = head[: blocks * 4].view(torch.int32).long()
    if int(counts.min()) < 0 or int(counts.sum()) != n:
        raise ValueError("pairs bucket whose block counts do not add up to its changes")
    low = head[_pad8(blocks * 4) :].view(torch.int16)[:n].long() & (_BLOCK - 1)
    index = torch.repeat_interleave(torch.arange(blocks, device=head.device), counts) * _BLOCK
    index += low
    if n and int(index.max()) >= words:
        raise ValueError("delta index beyond its bucket")
    return index


_SAMPLE_STRIDE = 61  # prime: no alignment with any tensor's row length


def _sampled_size(old: torch.Tensor, new: torch.Tensor) -> int:
    """The bytes a delta of these words would take, estimated from every 61st word: a delta
    that will not pay costs a 61st of the compare, not the whole encode."""
    a, b = old[::_SAMPLE_STRIDE], new[::_SAMPLE_STRIDE]
    changed, n = _changed(a, b)
    step = b.long() - a.long()
    wide = int(torch.count_nonzero((step < -127) | (step > 127)))
    scale = new.numel() / max(changed.numel(), 1)
    sizes = encoded_sizes(new.numel(), int(n * scale), new.element_size())
    # The gaps between sampled changes say little of the real ones: none counted long.
    gaps = gaps_size(int(n * scale), 0, int(wide * scale), new.element_size())
    return min(sizes[Encoding.PAIRS], sizes[Encoding.MASK], gaps)


class DeltaRefused(ValueError):
    """A delta this receiver cannot apply: another base, another layout, or a result whose
    checksum differs. It needs an anchor (or the versions from its own on, pulled)."""


class DeltaSource:
    """The trainer's side: what to send of each version, and the base the receivers hold."""

    def __init__(self, cfg: DeltaFields) -> None:
        self._cfg = cfg
        self._base: torch.Tensor | None = None
        self._layout: Layout | None = None
        self._version = -1
        self._since_anchor = 0
        self.fallbacks = 0
        """Versions sent full because the delta would have been larger than `max_fraction`."""

    @property
    def enabled(self) -> bool:
        return self._cfg.enabled

    @property
    def base_version(self) -> int | None:
        return self._version if self._base is not None else None

    def encode(
        self, flat: torch.Tensor, layout: Layout, version: int, *, anchor: bool
    ) -> Delta | None:
        """The delta to send as `version`; None when it goes full: asked for (`anchor`), due
        (`anchor_every`), a new layout, or a delta that does not pay."""
        if (
            not self._cfg.enabled
            or anchor
            or self._base is None
            or layout != self._layout
            or self._since_anchor + 1 >= self._cfg.anchor_every
        ):
            return None
        limit = int(self._cfg.max_fraction * layout.total_bytes)
        word = word_dtype(layout)
        if _sampled_size(self._base.view(word), flat.view(word)) > 1.5 * limit:
            self.fallbacks += 1  # surely too large: not worth a pass over everything
            return None
        delta = encode(self._base, flat, word, (self._version, version), limit=limit)
        if delta is None:
            self.fallbacks += 1
        return delta

    def sent(self, flat: torch.Tensor, layout: Layout, version: int, delta: Delta | None) -> None:
        """`version` reached the receivers, as `delta` or (None) in full: it is the new base."""
        if not self._cfg.enabled:
            return
        if delta is None or self._base is None:
            if self._base is None or self._base.numel() != flat.numel():
                self._base = torch.empty_like(flat)
            self._base.copy_(flat)
            self._since_anchor = 0
        else:
            apply(self._base, delta)  # touches the changed words only: cheaper than a copy
            self._since_anchor += 1
        self._layout, self._version = layout, version

    def forget(self) -> None:
        """The receivers' base is unknown (a failed send): the next version goes full."""
        self._base = None


class Held:
    """A receiver's own copy of the version its engine was last handed, for deltas to apply
    to (the engine may keep, and use, the tensors it was handed)."""

    def __init__(self) -> None:
        self.flat: torch.Tensor | None = None
        self.layout: Layout | None = None
        self.version: int | None = None

    def anchor(self, flat: torch.Tensor, layout: Layout, version: int) -> None:
        if (
            self.flat is None
            or self.flat.numel() != flat.numel()
            or self.flat.device != flat.device
        ):
            self.flat = torch.empty_like(flat)
        self.flat.copy_(flat)
        self.layout, self.version = layout, version

    def anchor_tensors(self, tensors: dict[str, torch.Tensor], version: int) -> None:
        """Hold `version` from its named tensors (as loaded from a file)."""
        buffer = FlatBuffer(Layout.of(tensors.items()), next(iter(tensors.values())).device)
        buffer.pack(tensors.items())
        self.flat, self.layout, self.version = buffer.flat, buffer.layout, version

    def apply(self, delta: Delta, layout: Layout) -> torch.Tensor:
        """The flat buffer of `delta.version` (a copy the caller may hand over); DeltaRefused
        when it does not apply to what is held — then nothing is held any more if the held
        copy was touched."""
        if self.flat is None or self.version != delta.base or layout != self.layout:
            raise DeltaRefused(
                f"version {delta.version} is a delta on {delta.base}; this worker holds "
                f"{self.version if self.flat is not None else 'nothing'}"
            )
        try:
            apply(self.flat, delta)
        except ValueError as exc:
            self.flat = None
            raise DeltaRefused(f"version {delta.version}: {exc}") from None
        if checksum(self.flat) != delta.checksum:
            self.flat = None
            raise DeltaRefused(f"version {delta.version}: checksum mismatch after the delta")
        self.version = delta.version
        return self.flat.clone()
