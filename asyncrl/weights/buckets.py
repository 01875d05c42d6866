"""Flat packing of named tensors: one byte buffer in a fixed order, sent in buckets, checksummed.

Layout. Tensors are sorted by name, so both ends agree whatever order the trainer iterates its
parameters in, and each starts at a byte offset aligned to `ALIGN` in one flat uint8 buffer whose
padding stays zero. A tensor is `flat[offset:offset + nbytes].view(dtype).view(shape)`; the
alignment makes that view legal for every dtype, so mixed dtypes (fp32, bf16, int64, bool...)
share one buffer and need no per-dtype grouping. The buffer travels as consecutive slices of
`bucket_bytes` (the last one shorter); a slice may cut a tensor in two — bytes are bytes.

Checksum. The sum of the buffer viewed as int64 words, wrapping modulo 2**64. It costs one pass
over memory, runs where the buffer lives (CPU or accelerator), and any single corrupted byte
changes it (the word moves by d·2**(8k) with 0 < |d| < 256, never a multiple of 2**64). It guards
against bugs, truncation and torn writes, not against an adversary. Since padding is zero and
every tensor starts on a word boundary, it also equals the sum of each tensor's own zero-padded
word sum: `checksum_tensors` gets the same value from loose tensors, e.g. loaded from a file.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import dataclass
from operator import itemgetter

import torch

ALIGN = 64
"""Byte alignment of every tensor in the flat buffer: a multiple of every dtype's size, and of a
cache line, so views are legal and copies stay vectorised."""

MAGIC = 0x4153_594E_4357_5453  # "ASYNCWTS": a header from anything else fails fast
_HEADER_WORDS = 8


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r} in weight layout")
    return dtype


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    """Byte offset in the flat buffer, a multiple of ALIGN."""

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass(frozen=True)
class Layout:
    """Where each named tensor lives in the flat buffer. Equal layouts mean reusable buffers."""

    specs: tuple[TensorSpec, ...]
    total_bytes: int
    """Size of the flat buffer: a multiple of ALIGN (hence of 8, for the int64 checksum)."""

    @classmethod
    def of(
        cls, tensors: Iterable[tuple[str, torch.Tensor]], narrow_to: torch.dtype | None = None
    ) -> Layout:
        """With `narrow_to` (a floating dtype), wider floating tensors get slots of that dtype:
        `FlatBuffer.pack` casts them on the way in."""
        specs: list[TensorSpec] = []
        offset = 0
        for name, tensor in sorted(tensors, key=itemgetter(0)):
            if specs and specs[-1].name == name:
                raise ValueError(f"tensor name {name!r} appears twice")
            dtype = tensor.dtype
            if (
                narrow_to is not None
                and dtype.is_floating_point
                and dtype.itemsize > narrow_to.itemsize
            ):
                dtype = narrow_to
            spec = TensorSpec(name, dtype, tuple(tensor.shape), offset)
            specs.append(spec)
            offset = _align(offset + spec.nbytes)
        return cls(tuple(specs), offset)

    def views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """Name → tensor view of `flat`, in layout order."""
        if flat.dtype != torch.uint8 or flat.numel() != self.total_bytes:
            raise ValueError(f"flat buffer must be uint8[{self.total_bytes}]")
        return {
            s.name: flat[s.offset : s.offset + s.nbytes].view(s.dtype).view(s.shape)
            for s in self.specs
        }

    def to_bytes(self) -> bytes:
        tensors = [
            [s.name, str(s.dtype).removeprefix("torch."), s.shape, s.offset] for s in self.specs
        ]
        return json.dumps({"total_bytes": self.total_bytes, "tensors": tensors}).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> Layout:
        obj = json.loads(data)
        specs = tuple(
            TensorSpec(name, _dtype(dtype), tuple(shape), offset)
            for name, dtype, shape, offset in obj["tensors"]
        )
        return cls(specs, obj["total_bytes"])


class FlatBuffer:
    """A zeroed flat buffer for one layout on one device, and its named views."""

    def __init__(self, layout: Layout, device: torch.device) -> None:
        self.layout = layout
        self.flat = torch.zeros(layout.total_bytes, dtype=torch.uint8, device=device)
        self.tensors = layout.views(self.flat)

    def pack(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy `tensors` (same names and shapes as the layout) into their slots, cast to the
        slots' dtypes."""
        Packer(self, tensors).through(self.layout.total_bytes)


class Packer:
    """Packs tensors into a `FlatBuffer` front to back, a byte range at a time: a sender posts
    bucket k while bucket k+1 is being packed, instead of packing everything first."""

    def __init__(self, buffer: FlatBuffer, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        sources = dict(tensors)
        self._todo = [
            (s, buffer.tensors[s.name].view(-1), sources[s.name].detach().reshape(-1))
            for s in buffer.layout.specs
        ]
        self._next = 0  # index into _todo of the first tensor not fully packed
        self._done = 0  # elements of that tensor packed already

    def through(self, end: int) -> None:
        """Pack every element that starts below byte `end` (bucket ends are multiples of the
        alignment, so a tensor is cut between two elements)."""
        while self._next < len(self._todo):
            spec, slot, source = self._todo[self._next]
            upto = min(slot.numel(), max(0, end - spec.offset) // spec.dtype.itemsize)
            if upto > self._done:
                slot[self._done : upto].copy_(source[self._done : upto])
                self._done = upto
            if self._done < slot.numel():
                return
            self._next, self._done = self._next + 1, 0


def bucket_ranges(total_bytes: int, bucket_bytes: int) -> list[tuple[int, int]]:
    """Byte ranges [start, end) of the buckets that cover the flat buffer, in sending order."""
    return [(s, min(s + bucket_bytes, total_bytes)) for s in range(0, total_bytes, bucket_bytes)]


def checksum(flat: torch.Tensor) -> int:
    """Wrapping int64 sum of a flat uint8 buffer whose length is a multiple of 8."""
    return int(flat.view(torch.int64).sum().item())


def wrap64(total: int) -> int:
    """A sum of checksums (of consecutive slices of one buffer, say) as the buffer's checksum."""
    return (total + 2**63) % 2**64 - 2**63


def checksum_tensors(tensors: Iterable[torch.Tensor]) -> int:
    """The checksum of the flat buffer these tensors would be packed into, without packing."""
    total = 0
    for tensor in tensors:
        raw = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
        pad = -raw.numel() % 8
        if pad or raw.storage_offset() % 8:
            raw = torch.cat([raw, raw.new_zeros(pad)])
        total += int(raw.view(torch.int64).sum().item())
    return wrap64(total)


@dataclass(frozen=True)
class Header:
    """First message of every version: what follows.

    A version on the wire: this header, int64[8] = MAGIC, version, total_bytes, bucket_bytes,
    layout_bytes, base, payload_bytes, 0; the layout as JSON, uint8[layout_bytes]; for a delta
    (base ≥ 0) its table; the buckets (of the flat buffer, or of a delta's payload); a trailer,
    int64[1] = the checksum of the flat buffer (a delta's: of the buffer it produces). The
    checksum comes last so that the sender computes it while the
    buckets are on the wire instead of before (a tenth of a 100 MB send on CPU).
    """

    version: int
    total_bytes: int
    bucket_bytes: int
    layout_bytes: int
    base: int = -1
    """The version a delta applies to (`asyncrl.weights.delta`); -1: the version in full."""
    payload_bytes: int = 0
    """A delta's payload size (its table's follows from `total_bytes`)."""

    @property
    def n_buckets(self) -> int:
        return len(bucket_ranges(self.total_bytes, self.bucket_bytes))

    def to_tensor(self, device: torch.device) -> torch.Tensor:
        words = [MAGIC, self.version, self.total_bytes, self.bucket_bytes, self.layout_bytes]
        words += [self.base, self.payload_bytes, 0]
        return torch.tensor(words, dtype=torch.int64, device=device)

    @staticmethod
    def empty(device: torch.device) -> torch.Tensor:
        return torch.zeros(_HEADER_WORDS, dtype=torch.int64, device=device)

    @classmethod
    def from_tensor(cls, tensor: torch.Tensor) -> Header:
        magic, version, total, bucket, layout_bytes, base, payload_bytes, _ = tensor.tolist()
        if magic != MAGIC:
            raise ValueError("not a weight-sync header")
        return cls(version, total, bucket, layout_bytes, base, payload_bytes)
