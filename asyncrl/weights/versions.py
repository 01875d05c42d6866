"""Versions as files: `VersionedDir`, and anchors and deltas that a receiver pulls by number.

    {root}/v{N:012d}.safetensors        an anchor: the plain state dict of version N (what the
                                        store transport always wrote), metadata version, checksum
    {root}/delta/v{N:012d}.safetensors  a delta: tensors `table` and `payload`, metadata version,
                                        base, checksum, word (`asyncrl.weights.delta`)

Both are written atomically (`store.VersionedDir`). A receiver reaches version N from the version
it holds by the deltas that chain from it (each names its base), and otherwise from the newest
anchor at or below N and the deltas after it; every step is checked against the checksum its
file carries. The store transport keeps its versions here when `weights.delta` is on; the
broadcast transport writes here too with `weights.delta.pull_dir`, so that a receiver that joins
or falls behind catches up on its own while the group goes on.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from asyncrl.weights.buckets import FlatBuffer, checksum, checksum_tensors
from asyncrl.weights.delta import Delta, Held

if TYPE_CHECKING:
    from collections.abc import Iterator

_SUFFIX = ".safetensors"
DELTA_DIR = "delta"

_VERSION = re.compile(r"v\d{12}")  # zero-padded: name order is version order


def version_name(version: int, suffix: str = "") -> str:
    return f"v{version:012d}{suffix}"


def version_path(store_dir: Path, version: int) -> Path:
    return store_dir / version_name(version, ".safetensors")


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


class VersionedDir:
    """Versions written atomically into one directory, the newest `keep` kept: version v is
    `{root}/v{v:012d}{suffix}`, a file or a directory of files. Each is written under a hidden
    temporary name beside it, fsynced, renamed over (atomic on POSIX) and the directory fsynced,
    so a reader finds a complete version or none; a writer that starts removes the partial ones
    a crashed writer left. The store transport writes safetensors files in it, SGLang's
    model and adapter directories (`asyncrl.sglang.publisher`)."""

    def __init__(self, root: Path, keep: int, suffix: str = "") -> None:
        self.root, self._keep, self._suffix = root, keep, suffix
        root.mkdir(parents=True, exist_ok=True)
        for partial in root.glob(f".v*{suffix}.tmp"):
            _remove(partial)

    def path(self, version: int) -> Path:
        return self.root / version_name(version, self._suffix)

    def write(self, version: int, fill: Callable[[Path], None]) -> Path:
        """The path of `version`, made by `fill(path)` unless it exists: versions are never
        reused, so an existing one is this version's (a resend after a failed announce)."""
        path = self.path(version)
        if path.exists():
            return path
        tmp = path.with_name(f".{path.name}.tmp")
        _remove(tmp)
        try:
            fill(tmp)
            for written in [*tmp.iterdir(), tmp] if tmp.is_dir() else [tmp]:
                _fsync(written)
            os.replace(tmp, path)
        except BaseException:
            _remove(tmp)
            raise
        _fsync(self.root)
        return path

    def prune(self) -> None:
        """Remove the versions older than the newest `keep`."""
        names = sorted(
            p.name
            for p in self.root.iterdir()
            if _VERSION.fullmatch(p.name.removesuffix(self._suffix))
        )
        for old in names[: -self._keep]:
            _remove(self.root / old)


def write_anchor(path: Path, buffer: FlatBuffer, version: int) -> None:
    meta = {"version": str(version), "checksum": str(checksum(buffer.flat))}
    save_file(buffer.tensors, path, metadata=meta)


def load_anchor(path: Path, version: int, device: torch.device) -> dict[str, torch.Tensor]:
    """The tensors of the anchor file of `version`; ValueError if it is not that, intact."""
    with safe_open(path, framework="pt", device=str(device)) as f:
        meta = f.metadata() or {}
        tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
    if meta.get("version") != str(version):
        raise ValueError(f"file holds version {meta.get('version')}")
    if meta.get("checksum") != str(checksum_tensors(tensors.values())):
        raise ValueError("checksum mismatch")
    return tensors


class DeltaLog:
    """The writer's side: anchors and deltas written and pruned (the delta directory is made
    with the first delta)."""

    def __init__(self, root: Path, keep: int, anchor_every: int) -> None:
        self.root = root
        self._keep = keep * anchor_every  # the deltas after each kept anchor: < anchor_every
        self._anchors = VersionedDir(root, keep, _SUFFIX)
        self._deltas: VersionedDir | None = None

    def write(self, buffer: FlatBuffer, version: int, delta: Delta | None) -> Path:
        """Write `version`: in full (`delta` None) or as `delta`; its path."""
        if delta is None:
            path = self._anchors.write(version, lambda tmp: write_anchor(tmp, buffer, version))
        else:
            if self._deltas is None:
                self._deltas = VersionedDir(self.root / DELTA_DIR, self._keep, _SUFFIX)
            path = self._deltas.write(version, lambda tmp: _write_delta(tmp, delta))
        self._anchors.prune()
        if self._deltas is not None:
            self._deltas.prune()
        return path


def read_to(root: Path, held: Held, version: int, device: torch.device) -> None:
    """Bring `held` to `version` from the files of a `DeltaLog` at `root`: by the deltas that
    chain from what it holds, else from the newest anchor at or below `version`.
    FileNotFoundError when the files are not there (pruned, or a directory this receiver cannot
    see); ValueError (DeltaRefused among them) when one does not verify."""
    if held.flat is not None and held.version is not None and held.version <= version:
        try:
            _chain(root, held, version, device)
            return
        except (FileNotFoundError, ValueError):
            pass  # no chain from what it holds: from an anchor
    anchor = max((v for v in _versions(root) if v <= version), default=None)
    if anchor is None:
        raise FileNotFoundError(f"no anchor at or below version {version} in {root}")
    path = root / version_name(anchor, _SUFFIX)
    held.anchor_tensors(load_anchor(path, anchor, device), anchor)
    _chain(root, held, version, device)


def _chain(root: Path, held: Held, version: int, device: torch.device) -> None:
    assert held.version is not None and held.layout is not None
    deltas = root / DELTA_DIR
    for v in sorted(v for v in _versions(deltas) if held.version < v <= version):
        delta = _read_delta(deltas / version_name(v, _SUFFIX), device)
        if delta.base == held.version:
            held.apply(delta, held.layout)
    if held.version != version:
        raise FileNotFoundError(f"no chain of deltas reaches version {version}")


def _versions(root: Path) -> Iterator[int]:
    for p in root.glob(f"v*{_SUFFIX}"):
        digits = p.name.removesuffix(_SUFFIX)[1:]
        if digits.isdigit() and p.name == version_name(int(digits), _SUFFIX):
            yield int(digits)


def _write_delta(path: Path, delta: Delta) -> None:
    meta = {
        "version": str(delta.version),
        "base": str(delta.base),
        "checksum": str(delta.checksum),
        "word": str(delta.word).removeprefix("torch."),
    }
    save_file({"table": delta.table, "payload": delta.payload}, path, metadata=meta)


def _read_delta(path: Path, device: torch.device) -> Delta:
    with safe_open(path, framework="pt", device=str(device)) as f:
        meta = f.metadata() or {}
        table, payload = f.get_tensor("table"), f.get_tensor("payload")
    word = getattr(torch, meta.get("word", ""), None)
    if word not in (torch.int16, torch.int32, torch.int64):
        raise ValueError(f"{path.name}: not a delta file")
    return Delta(
        int(meta["version"]), int(meta["base"]), int(meta["checksum"]), word, table.cpu(), payload
    )
