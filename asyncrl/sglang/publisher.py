"""Weight sync to SGLang servers through their own weight-update API (DESIGN §7).

The rollout workers' engines are SGLang servers, so there is no subscriber that receives tensors:
the trainer's publisher talks to each server over HTTP and sends the tensors itself.

- Membership: a worker whose engine is SGLang runs an `SglangSubscriber`, which registers its
  servers' URLs in the `weights` hash (`join:{id}` = {"host", "pid", "sglang": [urls]}) under
  the same lease as the broadcast transport; the publisher sends to the URLs of live leases.
- `weights.transport: broadcast`: a collective group of the trainer (rank 0) and every server's TP
  ranks (server i gets `rank_offset` 1 + the ranks before it). The group is made the way SGLang
  makes its side of it (`init_custom_process_group`: a TCPStore, `PrefixStore(group_name)`,
  torch's `_new_process_group_helper`), so that both ends derive the same store keys. It lives
  as long as the membership (an epoch, with a fresh group name so a surviving server never
  mistakes it for an old one); HCCL communicators in particular are kept across versions.
  One version: pause each server (`weights.pause_mode`), `/begin_weight_update` where it exists,
  `/update_weights_from_distributed` with names, dtypes and shapes in broadcast order while the
  trainer broadcasts each tensor from rank 0, `/end_weight_update`, `/continue_generation`.
- `weights.transport: store`: the version is written as a model directory
  `{store_dir}/sglang/v{version:012d}/model.safetensors` (atomically: written aside, renamed in)
  and each server loads it with `/update_weights_from_disk`; servers must see `store_dir`.

With `model.lora` (store transport only) a version is the adapter, written as the peft directory
`{store_dir}/sglang/v{version:012d}/` (`adapter_config.json`, `adapter_model.safetensors`; same
atomic write and retention). Each server, in this order: `/load_lora_adapter` as
`asyncrl-v{version}`, `/update_weight_version` (no abort), `/unload_lora_adapter` of the adapter
it held before. The engine names the adapter of the version its server reports
(`asyncrl.sglang.engine`), so there is always a loaded adapter under the name a request uses:
the new one is loaded before the version names it, and the old one goes only after (SGLang lets
its running requests finish first; one that names it after all reloads it from its directory,
which retention keeps a few versions). No pause: a request keeps its adapter to its end.

`flush_cache` goes with the pause mode: after `retract` the radix cache is flushed (retracted
requests are recomputed, so no key from old weights survives); with `in_place` it must not be
(SGLang refuses to flush with requests in the running batch). Servers older than 0.5.6 take no
pause mode (their pause aborts everything), so they are not paused: SGLang then applies an
update once the running requests have finished.

Versions always go in full: SGLang's weight-update endpoints take whole tensors (by name, over
the group or from a file) and have no way to patch part of one, so `weights.delta`
(`asyncrl.weights.delta`) is not offered for this transport.

Asynchrony is that of every publisher (`BackgroundPublisher`): `publish()` only copies into a
staging buffer, a background thread sends, and versions staged during a send coalesce.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import redis
import torch
import torch.distributed as dist
from safetensors.torch import save_file

from asyncrl.device import synchronize
from asyncrl.sglang.client import RequestFailure, http_info, http_json, parse_version
from asyncrl.sglang.engine import adapter_name
from asyncrl.weights.base import BackgroundPublisher, SyncRecord, announce
from asyncrl.weights.buckets import FlatBuffer
from asyncrl.weights.groups import (
    broadcast_all,
    comm_device,
    join_update_group,
    master_store,
    resolve_backend,
)
from asyncrl.weights.members import Lease, join_record, live_joins
from asyncrl.weights.versions import VersionedDir

if TYPE_CHECKING:
    from asyncrl.engines.base import RolloutEngine
    from asyncrl.model_config import LoraConfig
    from asyncrl.runstate import Keys
    from asyncrl.sglang.config import SglangWeightsConfig

log = logging.getLogger(__name__)

API_MIN = (0, 5, 0)
"""Oldest SGLang whose weight updates take `weight_version` (replies carry it since then)."""
PAUSE_MODES_SINCE = (0, 5, 6)
"""First SGLang whose /pause_generation takes a mode (older ones abort everything)."""
_MAX_FAILURES = 3  # failed deliveries of one version; then it waits for the next publish
_POLL_S = 0.1


def _timed_out(exc: Exception) -> bool:
    return isinstance(exc, TimeoutError) or (
        isinstance(exc, RequestFailure) and exc.reason == "timeout"
    )


@dataclass(frozen=True)
class ServerInfo:
    """What the publisher needs to know of one server (`/server_info`)."""

    url: str
    version: tuple[int, ...]
    ranks: int
    """Ranks the server contributes to a weight-update group (its TP size)."""

    @property
    def pause_modes(self) -> bool:
        return self.version >= PAUSE_MODES_SINCE

    @classmethod
    def probe(cls, url: str, timeout_s: float) -> ServerInfo:
        """Raises RequestFailure when unreachable, ValueError when unusable."""
        info = http_info(url, "server_info", timeout_s=timeout_s)
        if not isinstance(info, dict):
            raise ValueError(f"{url}/server_info: not an object")
        # `api_version`: the SGLang release whose API a non-SGLang server (`asyncrl serve`)
        # implements; SGLang itself reports its own release as `version`.
        raw = str(info.get("api_version") or info.get("version") or "")
        match = re.match(r"(\d+)\.(\d+)\.(\d+)", raw)
        if match is None:
            raise ValueError(f"{url}: server version {raw!r} is not a release number")
        version = tuple(int(x) for x in match.groups())
        if version < API_MIN:
            raise ValueError(f"{url}: SGLang {raw} is older than {'.'.join(map(str, API_MIN))}")
        for key in ("dp_size", "pp_size"):
            if int(info.get(key) or 1) != 1:
                raise ValueError(f"{url}: {key}={info[key]} is not supported; run one server each")
        return cls(url, version, int(info.get("tp_size") or 1))


def live_servers(client: redis.Redis, keys: Keys) -> list[str]:
    """URLs of the SGLang servers registered by workers whose lease holds, sorted."""
    joins, _ = live_joins(client, keys)
    return sorted({url for info in joins.values() for url in join_record(info).get("sglang", [])})


class SglangPublisher(BackgroundPublisher):
    """Trainer rank 0's end for SGLang engines (see the module doc)."""

    def __init__(
        self,
        cfg: SglangWeightsConfig,
        client: redis.Redis,
        keys: Keys,
        device: torch.device,
        on_record: Callable[[SyncRecord], None] | None = None,
        lora: LoraConfig | None = None,
    ) -> None:
        """`lora`: the run's `model.lora`; versions are then adapters (store transport)."""
        self._transport = cfg.transport
        self._lora = lora
        self._adapters: dict[str, int] = {}  # server → the adapter version it holds
        self._pause_mode = cfg.pause_mode
        self._backend = resolve_backend(cfg.backend, device)
        self._device = comm_device(self._backend, device) if cfg.transport == "broadcast" else None
        super().__init__(
            self._device or torch.device("cpu"), on_record, close_timeout_s=3 * cfg.sync_timeout_s
        )
        self._client, self._keys = client, keys
        self._timeout = timedelta(seconds=cfg.sync_timeout_s)
        self._http_timeout_s = cfg.sync_timeout_s
        self._store: dist.TCPStore | None = None
        self._master_addr = cfg.master_addr
        if cfg.transport == "broadcast":
            self._store = master_store(cfg.master_addr, cfg.master_port, self._timeout)
        else:
            if cfg.store_dir is None:
                raise ValueError("weights.store_dir is unset: resolve it ({run.dir}/weights) first")
            self._versions = VersionedDir(cfg.store_dir / "sglang", cfg.keep_last)
        self._group: dist.ProcessGroup | None = None
        self._group_name = ""
        self._members: list[ServerInfo] = []
        self._broken = False
        self._no_begin: set[str] = set()  # servers without /begin_weight_update
        self._holders: set[str] = set()  # servers that hold `_holders_version`
        self._holders_version: int | None = None
        self._unresponsive: set[str] = set()  # failed to join; retried at the next version
        self._failures = 0
        announce(client, keys, transport=f"sglang-{cfg.transport}", backend=self._backend)
        self._start()

    # -- the BackgroundPublisher hooks ---------------------------------------------------------

    def _wants_resend(self) -> bool:
        if self._failures >= _MAX_FAILURES:
            return False
        live = set(live_servers(self._client, self._keys))
        return bool(live - self._holders - self._unresponsive)

    def _send(self, buffer: FlatBuffer, version: int) -> tuple[int, int | None]:
        if version != self._holders_version:
            self._holders, self._holders_version = set(), version
            self._failures, self._unresponsive = 0, set()
        urls = [u for u in live_servers(self._client, self._keys) if u not in self._unresponsive]
        try:
            if self._transport == "broadcast":
                if self._broken or urls != [m.url for m in self._members]:
                    self._form(urls)
                sent_to = [m.url for m in self._members]
                if sent_to:
                    self._send_distributed(buffer, version)
            elif self._lora is not None:
                sent_to = self._send_adapter(buffer, version, urls)
            else:
                sent_to = self._send_disk(buffer, version, urls)
        except Exception as exc:  # whatever failed, the next try starts from a fresh group
            self._broken = True
            self._failures += 1
            raise RuntimeError(f"SGLang weight update to version {version} failed: {exc}") from exc
        self._holders |= set(sent_to)
        self._failures = 0
        announce(self._client, self._keys, sent_version=str(version))
        return (buffer.layout.total_bytes if sent_to else 0), len(sent_to)

    def _shutdown(self) -> None:
        self._release()

    def _probe(self, urls: list[str]) -> list[ServerInfo]:
        """The servers at `urls` that answer; the others are noted as unresponsive."""
        members = []
        for url in urls:
            try:
                members.append(ServerInfo.probe(url, self._http_timeout_s))
            except (RequestFailure, ValueError) as exc:
                log.warning("SGLang server %s left out of weight sync: %s", url, exc)
                self._unresponsive.add(url)
        return members

    # -- broadcast transport --------------------------------------------------------------------

    def _form(self, urls: list[str]) -> None:
        """A new group of the trainer and the servers at `urls` that can take part."""
        assert self._store is not None
        self._release()
        members = self._probe(urls)
        self._members = members
        self._broken = False
        if not members:
            return
        epoch = self._client.hincrby(self._keys.weights, "sglang_epoch", 1)
        name = f"asyncrl-{self._keys.run_id}-{epoch}"
        offsets = [1 + sum(m.ranks for m in members[:i]) for i in range(len(members))]
        world = 1 + sum(m.ranks for m in members)
        with ThreadPoolExecutor(len(members)) as pool:
            replies = [
                pool.submit(
                    http_json,
                    m.url,
                    "/init_weights_update_group",
                    {
                        "master_address": self._master_addr,
                        "master_port": self._store.port,
                        "rank_offset": offset,
                        "world_size": world,
                        "group_name": name,
                        "backend": self._backend,
                    },
                    timeout_s=self._http_timeout_s,
                )
                for m, offset in zip(members, offsets, strict=True)
            ]
            if self._device is not None and self._device.type == "cuda":
                torch.cuda.set_device(self._device)
            self._group_name = name
            try:
                self._group = join_update_group(
                    self._backend, self._store, 0, world, name, self._timeout
                )
            finally:
                failed = self._check_replies(members, replies, "init_weights_update_group")
        if failed:
            # A server that refused or vanished is the culprit; the others then only timed out
            # waiting for it. Left out, it is tried again at the next version.
            culprits = {u for u, exc in failed.items() if not _timed_out(exc)} or set(failed)
            self._unresponsive |= culprits
            raise RuntimeError(f"weight-update group {name}: {sorted(failed)} did not join")
        self._group_formed()
        log.info("SGLang weight-update group %s: %d server(s), %d ranks", name, len(members), world)

    def _check_replies(
        self, members: list[ServerInfo], replies: list[Future[Any]], what: str
    ) -> dict[str, Exception]:
        """The members whose call failed, with the failure (logged)."""
        failed: dict[str, Exception] = {}
        for m, reply in zip(members, replies, strict=True):
            try:
                result = reply.result(timeout=self._http_timeout_s)
                if isinstance(result, dict) and result.get("success") is False:
                    raise ValueError(result.get("message"))
            except Exception as exc:  # whatever went wrong, this server did not make it
                log.warning("%s on %s failed: %s", what, m.url, exc)
                failed[m.url] = exc
        return failed

    def _release(self) -> None:
        """Destroy the group here and, best effort, on the servers that may hold it (also after
        a failed forming, where some servers joined and the trainer did not)."""
        if not self._group_name:
            return
        group, name = self._group, self._group_name
        self._group, self._group_name = None, ""
        for m in self._members:
            try:
                http_json(
                    m.url,
                    "/destroy_weights_update_group",
                    {"group_name": name},
                    timeout_s=self._http_timeout_s,
                )
            except RequestFailure as exc:  # older servers lack it; dead ones cannot answer
                log.debug("destroy_weights_update_group on %s: %s", m.url, exc)
        if group is not None:
            dist.destroy_process_group(group)

    def _send_distributed(self, buffer: FlatBuffer, version: int) -> None:
        assert self._group is not None
        specs = buffer.layout.specs
        request = {
            "names": [s.name for s in specs],
            "dtypes": [str(s.dtype).removeprefix("torch.") for s in specs],
            "shapes": [list(s.shape) for s in specs],
            "group_name": self._group_name,
            "weight_version": str(version),
            "flush_cache": self._pause_mode != "in_place",
        }
        with self._quiet(self._members) as pool:
            replies = [
                pool.submit(
                    http_json,
                    m.url,
                    "/update_weights_from_distributed",
                    request,
                    timeout_s=self._http_timeout_s,
                )
                for m in self._members
            ]
            try:
                broadcast_all(self._group, [buffer.tensors[s.name] for s in specs])
                assert self._device is not None
                synchronize(self._device)
            finally:
                failed = self._check_replies(
                    self._members, replies, "update_weights_from_distributed"
                )
        if failed:
            raise RuntimeError(f"servers {sorted(failed)} did not take version {version}")

    # -- store transport ------------------------------------------------------------------------

    def _write(self, buffer: FlatBuffer, version: int) -> Path:
        """The version's directory in the store, with the oldest past `keep_last` removed."""

        def fill(tmp: Path) -> None:
            tmp.mkdir()
            if self._lora is not None:
                from asyncrl.lora import write_adapter

                write_adapter(tmp, buffer.tensors, self._lora)
            else:
                save_file(buffer.tensors, tmp / "model.safetensors", metadata={"format": "pt"})

        path = self._versions.write(version, fill)
        self._versions.prune()
        return path

    def _send_disk(self, buffer: FlatBuffer, version: int, urls: list[str]) -> list[str]:
        path = self._write(buffer, version)
        members = self._probe(urls)
        request = {"model_path": str(path), "weight_version": str(version)}
        with self._quiet(members) as pool:
            replies = [
                pool.submit(
                    http_json,
                    m.url,
                    "/update_weights_from_disk",
                    request,
                    timeout_s=self._http_timeout_s,
                )
                for m in members
            ]
            failed = self._check_replies(members, replies, "update_weights_from_disk")
        self._unresponsive |= set(failed)
        return [m.url for m in members if m.url not in failed]

    def _send_adapter(self, buffer: FlatBuffer, version: int, urls: list[str]) -> list[str]:
        path = self._write(buffer, version)
        members = self._probe(urls)
        with ThreadPoolExecutor(max(1, len(members))) as pool:
            replies = [pool.submit(self._switch, m.url, path, version) for m in members]
            failed = self._check_replies(members, replies, "switching to the adapter")
        self._unresponsive |= set(failed)
        return [m.url for m in members if m.url not in failed]

    def _switch(self, url: str, path: Path, version: int) -> None:
        """Load adapter `version` on the server at `url`, name its weights `version`, then drop
        the adapter it held (see the module doc for why in this order)."""
        name, timeout = adapter_name(version), self._http_timeout_s
        try:
            http_json(
                url,
                "/load_lora_adapter",
                {"lora_name": name, "lora_path": str(path), "pinned": False},
                timeout_s=timeout,
            )
        except RequestFailure as exc:
            # A retry after a later step failed finds the adapter loaded (SGLang's words).
            if "already loaded" not in exc.detail:
                raise
        http_json(
            url,
            "/update_weight_version",
            {"new_version": str(version), "abort_all_requests": False},
            timeout_s=timeout,
        )
        previous = self._adapters.get(url)
        self._adapters[url] = version
        if previous is not None and previous != version:
            try:
                http_json(
                    url,
                    "/unload_lora_adapter",
                    {"lora_name": adapter_name(previous)},
                    timeout_s=timeout,
                )
            except RequestFailure as exc:  # a restarted server no longer holds it
                log.info("unloading %s from %s: %s", adapter_name(previous), url, exc)

    # -- around every update --------------------------------------------------------------------

    @contextmanager
    def _quiet(self, members: list[ServerInfo]) -> Iterator[ThreadPoolExecutor]:
        """Pause and open a weight update on each member, close and continue afterwards; yields
        a thread pool large enough for one blocking call per member."""
        mode = self._pause_mode
        paused: list[ServerInfo] = []
        begun: list[ServerInfo] = []
        with ThreadPoolExecutor(max(1, len(members))) as pool:
            try:
                for m in members:
                    if mode != "none" and m.pause_modes:
                        http_json(
                            m.url,
                            "/pause_generation",
                            {"mode": mode},
                            timeout_s=self._http_timeout_s,
                        )
                        paused.append(m)
                    if self._begin(m):
                        begun.append(m)
                yield pool
            finally:
                for m in begun:
                    self._call_quietly(m.url, "/end_weight_update")
                for m in paused:
                    self._call_quietly(m.url, "/continue_generation")

    def _begin(self, m: ServerInfo) -> bool:
        """Open a weight update where the server has the endpoint (newer SGLang)."""
        if m.url in self._no_begin:
            return False
        try:
            http_json(m.url, "/begin_weight_update", {}, timeout_s=self._http_timeout_s)
        except RequestFailure as exc:
            if exc.status != 404:
                raise
            self._no_begin.add(m.url)
            return False
        return True

    def _call_quietly(self, url: str, path: str) -> None:
        # Runs in `finally`: a failure here must not hide the update's own outcome.
        try:
            http_json(url, path, {}, timeout_s=self._http_timeout_s)
        except RequestFailure as exc:
            log.warning("%s%s failed: %s", url, path, exc)


class SglangSubscriber:
    """A rollout worker's end when its engine is SGLang: it registers the servers' URLs for the
    publisher (under a lease kept alive by its own thread) and reports what they hold. Weights
    go straight from the trainer to the servers, so it never hands any over."""

    def __init__(
        self,
        cfg: SglangWeightsConfig,
        client: redis.Redis,
        keys: Keys,
        worker_id: str,
        urls: list[str],
        *,
        http_timeout_s: float = 5.0,
    ) -> None:
        self._client, self._keys, self._id = client, keys, worker_id
        self._urls = [u.rstrip("/") for u in urls]
        self._http_timeout_s = http_timeout_s
        self._lease = Lease(client, keys, worker_id, cfg.lease_s, {"sglang": self._urls})

    @classmethod
    def for_engine(
        cls,
        cfg: SglangWeightsConfig,
        client: redis.Redis,
        keys: Keys,
        worker_id: str,
        engine: RolloutEngine | None,
    ) -> SglangSubscriber:
        """The subscriber of a worker whose engine is `engine` (its servers' URLs)."""
        from asyncrl.sglang.engine import SglangEngine

        if not isinstance(engine, SglangEngine):
            raise ValueError("weights.type=sglang needs rollout.engine.type=sglang")
        return cls(cfg, client, keys, worker_id, engine.urls)

    @property
    def version(self) -> int | None:
        """The version every server holds (the smallest); None if one does not answer."""
        try:
            return min(
                parse_version(
                    http_info(url, "model_info", timeout_s=self._http_timeout_s)["weight_version"]
                )
                for url in self._urls
            )
        except (RequestFailure, TypeError, KeyError):
            return None

    def wait_for_version(self, min_version: int, timeout_s: float) -> int:
        deadline = time.monotonic() + timeout_s
        while True:
            version = self.version
            if version is not None and version >= min_version:
                return version
            if time.monotonic() > deadline:
                raise TimeoutError(f"SGLang servers not at version ≥ {min_version} in {timeout_s}s")
            time.sleep(_POLL_S)

    def close(self) -> None:
        self._lease.end()
