"""The HTTP endpoint of every asyncrl process: `/metrics` and `/healthz`."""

from __future__ import annotations

import errno
import socket
import threading
from collections.abc import Callable, Iterable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from asyncrl.metrics.roles import REGISTRY

HealthCheck = Callable[[], tuple[bool, str]]
"""Returns (healthy, reason); the reason is the 503 body when unhealthy."""


class MetricsServer(ThreadingHTTPServer):
    """The process' HTTP endpoint; `port` is the bound one (useful with port 0)."""

    daemon_threads = True

    @property
    def port(self) -> int:
        return int(self.server_address[1])

    def close(self) -> None:
        self.shutdown()
        self.server_close()


def serve(
    host: str = "127.0.0.1",
    port: int = 0,
    health: HealthCheck = lambda: (True, "ok"),
    registry: CollectorRegistry = REGISTRY,
) -> MetricsServer:
    """Serves `/metrics` (Prometheus text format) and `/healthz` from a daemon thread.

    `/healthz` answers 200 `ok` while `health()` returns (True, _) — for the roles: connected to
    Redis and holding weights — else 503 with the reason. Port 0 picks a free port. A port
    another process holds is a `ConfigError` naming `metrics.port` (so the command exits 2 with
    one line, like any config error).
    """

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            path = self.path.split("?", 1)[0]
            if path == "/metrics":
                self._reply(200, generate_latest(registry), CONTENT_TYPE_LATEST)
            elif path == "/healthz":
                try:
                    ok, reason = health()
                except Exception as exc:  # a probe must answer, whatever the check does
                    ok, reason = False, f"health check failed: {exc!r}"
                body = "ok" if ok else reason
                self._reply(200 if ok else 503, f"{body}\n".encode(), "text/plain; charset=utf-8")
            else:
                self._reply(404, b"not found\n", "text/plain; charset=utf-8")

        def _reply(self, code: int, body: bytes, content_type: str) -> None:
            self.send_response(code)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            """Silent: a scrape every few seconds would flood the process log."""

    try:
        server = MetricsServer((host, port), Handler)
    except OSError as exc:
        if exc.errno != errno.EADDRINUSE:
            raise
        from asyncrl.config import ConfigError

        raise ConfigError(port_in_use(host, port)) from None
    threading.Thread(target=server.serve_forever, name="metrics-http", daemon=True).start()
    return server


def port_in_use(host: str, port: int, uses: str = "") -> str:
    """The one-line error for a metrics port that another process holds; `uses` says how the
    port follows from `metrics.port` where it is not that value itself."""
    return (
        f"metrics.port: {host}:{port} is already in use{uses} (another asyncrl process on this "
        "host with the same config?): set metrics.port to a free port, or to 0 to serve no "
        "/metrics"
    )


def first_taken(host: str, ports: Iterable[int]) -> int | None:
    """The first of `ports` that another process holds on `host`, None if all are free. A probe
    for launchers that hand out ports before starting anything; `serve` still reports a port
    taken in between."""
    for port in ports:
        with socket.socket() as probe:
            # As `MetricsServer` binds (SO_REUSEADDR): a port left in TIME_WAIT is free.
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind((host, port))
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE:
                    return port
                raise
    return None
