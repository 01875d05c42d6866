"""HTTP to SGLang servers: one JSON exchange, the pool of servers in rotation, the launcher.

Plain `http.client` and JSON: nothing of SGLang is imported, so the servers may run from their
own environment. The engine (`asyncrl.sglang.engine`) and the weight publisher
(`asyncrl.sglang.publisher`) both speak through these helpers; `RequestFailure` is the one error
of an exchange, and says whether the server is to blame and whether a retry may succeed.
"""

from __future__ import annotations

import http.client
import json
import logging
import os
import signal
import subprocess
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from asyncrl.device import sglang_device_args, visible_devices_env

if TYPE_CHECKING:
    from asyncrl.model_config import LoraConfig
    from asyncrl.sglang.config import SglangEngineConfig

log = logging.getLogger(__name__)


class RequestFailure(Exception):
    """One failed HTTP exchange. `server_fault`: the server, not the request, is to blame (it
    leaves the rotation); `retry`: another attempt may succeed."""

    def __init__(
        self,
        reason: str,
        detail: str,
        *,
        server_fault: bool,
        retry: bool,
        status: int | None = None,
    ) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason, self.detail = reason, detail
        self.server_fault, self.retry = server_fault, retry
        self.status = status
        """HTTP status of a reply that came with an error status."""


def malformed(detail: str) -> RequestFailure:
    return RequestFailure("malformed", detail, server_fault=True, retry=True)


class _Idle:
    """Keep-alive connections not in use, per server: a request takes one (or opens one) and
    gives it back once its reply is read in full. Servers that close after each reply (HTTP/1.0,
    as `asyncrl serve`) leave nothing here."""

    MAX_PER_SERVER = 32

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._idle: dict[tuple[str, str, int | None], list[http.client.HTTPConnection]] = {}

    def take(self, key: tuple[str, str, int | None]) -> http.client.HTTPConnection | None:
        with self._lock:
            conns = self._idle.get(key)
            return conns.pop() if conns else None

    def give(self, key: tuple[str, str, int | None], conn: http.client.HTTPConnection) -> None:
        with self._lock:
            conns = self._idle.setdefault(key, [])
            if len(conns) < self.MAX_PER_SERVER:
                conns.append(conn)
                return
        conn.close()


_IDLE = _Idle()

# What a reused connection raises when the server had closed it while it was idle.
_STALE = (ConnectionResetError, ConnectionAbortedError, BrokenPipeError)


def http_json(url: str, path: str, body: Any = None, *, timeout_s: float) -> Any:
    """One request to `url + path` (POST with a JSON body when `body` is given, else GET);
    the decoded JSON reply, None for an empty one. Raises RequestFailure.

    Connections are kept alive where the server allows it and reused by later requests."""
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port
    key = (parts.scheme, host, port)
    conn_cls = (
        http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    )
    data = None if body is None else json.dumps(body).encode()
    conn = _IDLE.take(key)
    reused = conn is not None
    if conn is None:
        conn = conn_cls(host, port, timeout=timeout_s)
    try:
        while True:
            conn.timeout = timeout_s
            if conn.sock is not None:
                conn.sock.settimeout(timeout_s)
            try:
                conn.request(
                    "GET" if body is None else "POST",
                    parts.path.rstrip("/") + path,
                    body=data,
                    headers={"Content-Type": "application/json"} if data is not None else {},
                )
                reply = conn.getresponse()
                payload = reply.read()
                break
            except _STALE:
                conn.close()
                if not reused:
                    raise
                # The server closed this idle connection before the request reached it.
                conn, reused = conn_cls(host, port, timeout=timeout_s), False
    except TimeoutError as exc:
        conn.close()
        raise RequestFailure(
            "timeout", f"{url}{path}: {exc}", server_fault=True, retry=True
        ) from None
    except (OSError, http.client.HTTPException) as exc:
        conn.close()
        raise RequestFailure(
            "unreachable",
            f"{url}{path}: {type(exc).__name__}: {exc}",
            server_fault=True,
            retry=True,
        ) from None
    if reply.will_close:
        conn.close()
    else:
        _IDLE.give(key, conn)
    if reply.status >= 400:
        # 5xx: the server's fault, worth another try; 4xx: the request's, whose reply says why.
        server_fault = reply.status >= 500
        detail = f"{url}{path}: HTTP {reply.status}"
        if not server_fault:
            detail += f": {payload[:300].decode(errors='replace')}"
        raise RequestFailure(
            "server_error" if server_fault else "rejected",
            detail,
            server_fault=server_fault,
            retry=server_fault,
            status=reply.status,
        )
    if not payload.strip():
        return None
    try:
        return json.loads(payload)
    except ValueError:
        raise malformed(f"{url}{path}: reply is not JSON: {payload[:100]!r}") from None


_LEGACY_INFO: set[str] = set()
"""Servers found to answer only the older names (/get_model_info, /get_server_info)."""


def http_info(url: str, name: str, *, timeout_s: float) -> Any:
    """GET `/{name}` (`model_info` or `server_info`, the names SGLang 0.5.23 documents) of
    the server at `url`. A server that answers 404 (an older SGLang) is asked `/get_{name}`
    instead, from then on: detected once per server."""
    url = url.rstrip("/")
    if url not in _LEGACY_INFO:
        try:
            return http_json(url, f"/{name}", timeout_s=timeout_s)
        except RequestFailure as exc:
            if exc.status != 404:
                raise
            _LEGACY_INFO.add(url)
            log.info("%s has no /%s: using the older /get_%s", url, name, name)
    return http_json(url, f"/get_{name}", timeout_s=timeout_s)


def parse_version(value: Any) -> int:
    """A weight version name as asyncrl uses it: an integer; SGLang's initial "default" is 0."""
    if value == "default":
        return 0
    try:
        return int(value)
    except (TypeError, ValueError):
        raise malformed(f"weight version {value!r} is not an integer") from None


@dataclass
class Server:
    url: str
    alive: bool = True
    inflight: int = 0
    next_probe: float = 0.0
    probing: bool = False


@dataclass
class ServerPool:
    """The servers in rotation. A request goes to the live server with the fewest requests in
    flight; a server that failed leaves the rotation and rejoins once /health answers 200.
    Dead servers are probed lazily by the threads that ask for a server (at most once per
    `health_interval_s` each, and at once when none is alive), so nothing runs in the
    background."""

    urls: list[str]
    health_interval_s: float
    health_timeout_s: float
    _servers: list[Server] = field(init=False)
    _lock: threading.Lock = field(init=False, default_factory=threading.Lock)

    def __post_init__(self) -> None:
        if not self.urls:
            raise ValueError("no SGLang server URLs")
        self._servers = [Server(url.rstrip("/")) for url in self.urls]

    def alive(self) -> list[str]:
        with self._lock:
            return [s.url for s in self._servers if s.alive]

    def acquire(self) -> Server:
        self._probe_dead()
        with self._lock:
            alive = [s for s in self._servers if s.alive]
            if not alive:
                raise RequestFailure(
                    "no_server", "no SGLang server is in rotation", server_fault=False, retry=True
                )
            server = min(alive, key=lambda s: s.inflight)
            server.inflight += 1
            return server

    def release(self, server: Server, *, failed: RequestFailure | None = None) -> None:
        with self._lock:
            server.inflight -= 1
            if failed is not None and failed.server_fault and server.alive:
                server.alive = False
                server.next_probe = time.monotonic() + self.health_interval_s
                log.warning("SGLang server %s out of rotation: %s", server.url, failed)

    def _probe_dead(self) -> None:
        now = time.monotonic()
        with self._lock:
            none_alive = not any(s.alive for s in self._servers)
            due = [
                s
                for s in self._servers
                if not s.alive and not s.probing and (none_alive or s.next_probe <= now)
            ]
            for s in due:
                s.probing = True
        for server in due:
            try:
                http_json(server.url, "/health", timeout_s=self.health_timeout_s)
                healthy = True
            except RequestFailure:
                healthy = False
            with self._lock:
                server.probing = False
                server.alive = healthy
                server.next_probe = time.monotonic() + self.health_interval_s
            if healthy:
                log.info("SGLang server %s back in rotation", server.url)


def _flags(args: Mapping[str, str | int | float | bool]) -> list[str]:
    out: list[str] = []
    for name, value in args.items():
        flag = "--" + name.replace("_", "-")
        if value is True:
            out.append(flag)
        elif value is not False:
            out += [flag, str(value)]
    return out


def lora_flags(lora: LoraConfig | None) -> list[str]:
    """SGLang's flags for serving `model.lora`'s adapters, loaded after start: with no adapter
    at start SGLang needs the rank and the targets up front. Two adapters at most are loaded
    and in one batch: the current version, and the previous one while its last requests end."""
    if lora is None:
        return []
    targets = ["all"] if lora.target_modules == "all-linear" else lora.target_modules
    return [
        "--enable-lora",
        "--max-lora-rank", str(lora.rank),
        "--lora-target-modules", *targets,
        "--max-loras-per-batch", "2",
        "--max-loaded-loras", "2",
    ]  # fmt: skip


def launch_servers(
    cfg: SglangEngineConfig, model_path: str, lora: LoraConfig | None = None
) -> list[subprocess.Popen[bytes]]:
    """Start `cfg.servers` SGLang servers (with `lora`'s adapter flags; `server_args` come
    after, so they win) and wait until each answers /health. Each gets its own session (SGLang
    forks scheduler and detokenizer processes) so that `stop_servers` ends the whole tree
    through the handle."""
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for i in range(cfg.servers):
            cmd = [
                cfg.python, "-m", "sglang.launch_server",
                "--model-path", model_path,
                "--host", cfg.host,
                "--port", str(cfg.port + i),
                "--weight-version", "0",
                *sglang_device_args(cfg.device),
                *lora_flags(lora),
                *_flags(cfg.server_args),
            ]  # fmt: skip
            devices = range(i * cfg.devices_per_server, (i + 1) * cfg.devices_per_server)
            env = {**os.environ, **visible_devices_env(cfg.device, list(devices))}
            # Log-probs must be of the tempered distribution, the one sampled from.
            env.pop("SGLANG_RETURN_ORIGINAL_LOGPROB", None)
            log.info("starting SGLang server %d: %s", i, " ".join(cmd))
            procs.append(subprocess.Popen(cmd, env=env, start_new_session=True))
        deadline = time.monotonic() + cfg.startup_timeout_s
        for i, proc in enumerate(procs):
            url = f"http://{cfg.host}:{cfg.port + i}"
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"SGLang server {url} exited with code {proc.returncode}")
                try:
                    http_json(url, "/health", timeout_s=cfg.health_timeout_s)
                    break
                except RequestFailure:
                    if time.monotonic() > deadline:
                        raise TimeoutError(
                            f"SGLang server {url} not healthy after {cfg.startup_timeout_s:.0f}s"
                        ) from None
                    time.sleep(1.0)
    except BaseException:
        stop_servers(procs)
        raise
    return procs


def stop_servers(procs: list[subprocess.Popen[bytes]], timeout_s: float = 30.0) -> None:
    for proc in procs:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
    for proc in procs:
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
