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
With `weights.delta` the versions between anchors are delta files under `{store_dir}/delta/`
(`asyncrl.weights.versions`): a subscriber applies the chain from what it holds, or from the
newest anchor, checking each step's checksum.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import SafetensorError

from asyncrl.weights.base import (
    POLL_S,
    BackgroundPublisher,
    BackgroundSubscriber,
    SyncRecord,
    announce,
    text,
)
from asyncrl.weights.buckets import FlatBuffer
from asyncrl.weights.config import StoreWeightsConfig
from asyncrl.weights.delta import DeltaSource, Held
from asyncrl.weights.versions import DELTA_DIR, DeltaLog, load_anchor, read_to

if TYPE_CHECKING:
    import redis

    from asyncrl.runstate import Keys

log = logging.getLogger(__name__)


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
        self._log = DeltaLog(cfg.store_dir, cfg.keep_last, cfg.delta.anchor_every)
        self._delta = DeltaSource(cfg.delta)
        announce(client, keys, transport="store", delta=str(int(cfg.delta.enabled)))
        self._start()

    def _send(self, buffer: FlatBuffer, version: int) -> tuple[int, int | None]:
        # A restarted publisher writes an anchor first: it knows no base (nor does a reader
        # of a directory it left, whose newest files may be of other versions).
        delta = self._delta.encode(buffer.flat, buffer.layout, version, anchor=False)
        path = self._log.write(buffer, version, delta)
        announce(
            self._client,
            self._keys,
            transport="store",
            store_version=str(version),
            store_path=str(path),
        )
        self._delta.sent(buffer.flat, buffer.layout, version, delta)
        self._sent_delta = delta is not None
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
    """Loads the announced version: an anchor directly; a delta by pulling the chain that
    leads to it (`DeltaLog.read_to`) from what it holds or from the newest anchor."""

    def _setup(self, cfg: StoreWeightsConfig) -> None:
        self._dir = cfg.store_dir
        self._rejected: int | None = None  # a bad file is not retried until a newer one comes
        self._held = Held()

    def _step(self) -> None:
        self._doorbell.wait(POLL_S)
        raw_version, raw_path, raw_delta = self._client.hmget(
            self._keys.weights, ["store_version", "store_path", "delta"]
        )
        if raw_version is None or raw_path is None:
            return
        version, path = int(text(raw_version)), Path(text(raw_path))
        if version == self._rejected or (self._version is not None and version <= self._version):
            return
        is_delta = path.parent.name == DELTA_DIR
        root = self._dir or (path.parent.parent if is_delta else path.parent)
        try:
            if is_delta:
                read_to(root, self._held, version, self._device)
                assert self._held.flat is not None and self._held.layout is not None
                tensors = self._held.layout.views(self._held.flat.clone())
            else:
                tensors = load_anchor(root / path.name, version, self._device)
                if raw_delta is not None and text(raw_delta) == "1":
                    self._held.anchor_tensors(tensors, version)
        except FileNotFoundError:
            return  # pruned while we were away; a newer version has been announced
        except (SafetensorError, ValueError, OSError) as exc:
            log.warning("%s: weights version %d at %s rejected: %s", self._id, version, path, exc)
            self._rejected = version
            return
        self._hand_over(tensors, version)

    def _leave(self) -> None:
        self._doorbell.close()
