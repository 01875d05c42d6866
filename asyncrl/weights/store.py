"""Weight sync through a shared directory of safetensors files (DESIGN §7).

Version v goes to `{store_dir}/v{v:012d}.safetensors`: written under a temporary name in the same
directory, fsynced, renamed over (atomic on POSIX), the directory fsynced, and only then announced
in the `weights` hash (`store_version`, `store_path`; `transport` = "store") with a doorbell
PUBLISH. A reader thus finds a complete file or none: a partial one carries a name nobody
announces, and a publisher that starts removes those a crashed one left. The file's metadata holds
`version` and `checksum` (see `buckets`), both verified before anything is handed over; a file
that fails to parse or to verify is skipped and logged. The last `keep_last` versions are kept —
a reader that loses the race to a deletion takes the newer file announced since.

Files are plain safetensors state dicts, readable by any tool (e.g. an inference server's
load-from-disk). A new worker loads the newest one first, so the store also serves as bootstrap.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from asyncrl.weights.base import (
    POLL_S,
    BackgroundPublisher,
    BackgroundSubscriber,
    SyncRecord,
    announce,
    text,
)
from asyncrl.weights.buckets import FlatBuffer, checksum, checksum_tensors
from asyncrl.weights.config import StoreWeightsConfig

if TYPE_CHECKING:
    import redis

    from asyncrl.runstate import Keys

log = logging.getLogger(__name__)

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


class StorePublisher(BackgroundPublisher):
    def __init__(
        self,
        cfg: StoreWeightsConfig,
        client: redis.Redis,
        keys: Keys,
        device: torch.device,
        on_record: Callable[[SyncRecord], None] | None,
    ) -> None:
        if cfg.store_dir is None:
            raise ValueError("weights.store_dir is unset: resolve it ({run.dir}/weights) first")
        # Staged in host memory: that is where the file is written from.
        super().__init__(torch.device("cpu"), on_record, close_timeout_s=3 * cfg.sync_timeout_s)
        self._client, self._keys = client, keys
        self._versions = VersionedDir(cfg.store_dir, cfg.keep_last, ".safetensors")
        announce(client, keys, transport="store")
        self._start()

    def _send(self, buffer: FlatBuffer, version: int) -> tuple[int, int | None]:
        def fill(tmp: Path) -> None:
            meta = {"version": str(version), "checksum": str(checksum(buffer.flat))}
            save_file(buffer.tensors, tmp, metadata=meta)

        path = self._versions.write(version, fill)
        announce(
            self._client,
            self._keys,
            transport="store",
            store_version=str(version),
            store_path=str(path),
        )
        self._versions.prune()
        return path.stat().st_size, None

    def _wants_resend(self) -> bool:
        # Subscribers learn of a version only from its announce: one that failed (Redis down),
        # or that Redis lost (restarted empty), is made again, or joining workers would wait for
        # it until the next publish.
        last = self.stats().last
        if last is not None and not last.ok:
            return True
        return self._client.hget(self._keys.weights, "store_version") is None

    def _shutdown(self) -> None:
        """Nothing is held between writes."""


class StoreSubscriber(BackgroundSubscriber[StoreWeightsConfig]):
    def _setup(self, cfg: StoreWeightsConfig) -> None:
        self._dir = cfg.store_dir
        self._rejected: int | None = None  # a bad file is not retried until a newer one comes

    def _step(self) -> None:
        self._doorbell.wait(POLL_S)
        raw_version, raw_path = self._client.hmget(
            self._keys.weights, ["store_version", "store_path"]
        )
        if raw_version is None or raw_path is None:
            return
        version, path = int(text(raw_version)), Path(text(raw_path))
        if version == self._rejected or (self._version is not None and version <= self._version):
            return
        if self._dir is not None:
            path = self._dir / path.name
        try:
            tensors = self._load(path, version)
        except FileNotFoundError:
            return  # pruned while we were away; a newer version has been announced
        except (SafetensorError, ValueError, OSError) as exc:
            log.warning("%s: weights version %d at %s rejected: %s", self._id, version, path, exc)
            self._rejected = version
            return
        self._hand_over(tensors, version)

    def _load(self, path: Path, version: int) -> dict[str, torch.Tensor]:
        with safe_open(path, framework="pt", device=str(self._device)) as f:
            meta = f.metadata() or {}
            tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
        if meta.get("version") != str(version):
            raise ValueError(f"file holds version {meta.get('version')}")
        if meta.get("checksum") != str(checksum_tensors(tensors.values())):
            raise ValueError("checksum mismatch")
        return tensors

    def _leave(self) -> None:
        self._doorbell.close()
