"""The asyncio HTTP/1.1 server `asyncrl env-server` and `asyncrl agent-server` run on: written for
their own clients (and httpx), hardened against every other, on one asyncio event loop.

It reads requests with keep-alive and `Content-Length` bodies, enough for those clients and no
general server. What one request may cost is bounded (`Limits`): a request must arrive whole
within `read_timeout_s` of its first byte (a sweep about once a second cuts off one that does
not, with a 408), a connection idle for `KEEP_ALIVE_S` is closed, a body over `max_body_bytes`
is refused (413) and large ones are read a few at a time, a connection past `max_connections`
gets a 503, and a request without the shared token a 401 (`/health` and `/metrics` excepted:
probes and scrapes). Out of descriptors, the accept loop waits a second and logs a line a
minute. What a request means is the `App`'s business: this layer only frames it.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import logging
import math
import resource
import signal
import socket
import threading
import time
from http import HTTPStatus
from typing import Any, NamedTuple, Protocol

from asyncrl.web.auth import Token, check_host

log = logging.getLogger(__name__)

DEFAULT_MAX_BODY_BYTES = 4 << 20
DEFAULT_MAX_CONNECTIONS = 4096
DEFAULT_READ_TIMEOUT_S = 30.0

# A pooled connection idle for this long is closed; clients reuse one only well within it.
KEEP_ALIVE_S = 120.0
_CLOSE_TIMEOUT_S = 5.0
_MAX_HEAD_BYTES = 64 << 10
# Bodies above this size are read and parsed a few at a time, so memory stays a small multiple
# of `--max-body-bytes` however many clients send one at once.
_LARGE_BODY_BYTES = 256 << 10
_LARGE_BODIES_AT_ONCE = 2
# A worker opens many sessions at once (a batch of prompts × n): a short backlog would reset
# connections in such a burst.
_BACKLOG = 4096
# Descriptors kept for the server's own files, the listening socket and the environments.
_SPARE_FDS = 64
_OUT_OF_FDS_LOG_EVERY_S = 60.0
_OPEN_PATHS = ("/health", "/metrics")  # probes and scrapes: no session, no token


class Refused(Exception):
    """A request answered with `status` and `{"error": reason, "detail": detail}`."""

    def __init__(self, status: HTTPStatus, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.status, self.reason, self.detail = status, reason, detail


class Reply(NamedTuple):
    status: HTTPStatus
    data: bytes
    content_type: str = "application/json"


class Body:
    """A request body, parsed once as a JSON object (the bytes dropped then)."""

    def __init__(self, data: bytes) -> None:
        self._data: bytes | None = data
        self._parsed: dict[str, Any] | Refused | None = None

    def parse(self) -> None:
        if self._data is None:
            return
        data, self._data = self._data, None
        try:
            body = json.loads(data or b"{}")
        except (ValueError, RecursionError) as exc:
            self._parsed = Refused(HTTPStatus.BAD_REQUEST, "malformed", f"not JSON: {exc}")
            return
        if not isinstance(body, dict):
            self._parsed = Refused(HTTPStatus.BAD_REQUEST, "malformed", "body is not an object")
            return
        self._parsed = body

    def json(self) -> dict[str, Any]:
        self.parse()
        if isinstance(self._parsed, Refused):
            raise self._parsed
        assert self._parsed is not None
        return self._parsed


class Request:
    def __init__(
        self, method: str, path: str, headers: dict[str, str], body: Body, keep_alive: bool
    ) -> None:
        self.method, self.path, self.headers = method, path, headers
        self.body, self.keep_alive = body, keep_alive

    def json(self) -> dict[str, Any]:
        return self.body.json()


class App(Protocol):
    """What the server serves."""

    async def answer(self, request: Request) -> Reply:
        """The reply to `request`, whatever went wrong (the server's own bugs included)."""
        ...

    async def background(self) -> None:
        """Work beside the requests while the server runs; cancelled when it stops."""
        ...

    async def close_all(self) -> None:
        """At shutdown, before the connections close: what the app holds released."""
        ...


class Limits:
    """What one request may cost the server: a shared secret, a body size, read deadlines."""

    def __init__(self, token: str | None, max_body_bytes: int, read_timeout_s: float) -> None:
        self.token = Token(token)
        self.max_body_bytes = max_body_bytes
        self.read_timeout_s = read_timeout_s
        self.large_bodies = asyncio.Semaphore(_LARGE_BODIES_AT_ONCE)

    def authorized(self, headers: dict[str, str]) -> bool:
        return self.token.admits(headers.get("authorization"))


class _Deadline:
    """When a connection's current wait must end (loop time): the server's sweep checks it
    about once a second and cuts off the connection past it. A plain float per connection, not a
    timer per request: two `asyncio.timeout`s tripled what reading a request cost (6 → 17 µs)."""

    def __init__(self) -> None:
        self.at = math.inf
        self.reading = False  # a request begun: cut off, it gets a 408
        self.expired = False

    def set(self, seconds: float, reading: bool) -> None:
        self.at = asyncio.get_running_loop().time() + seconds
        self.reading = reading


async def _read_request(
    reader: asyncio.StreamReader, limits: Limits, deadline: _Deadline
) -> Request | None:
    """The next request of a connection; None when the client closed it between requests.
    It may wait `KEEP_ALIVE_S` for the first byte; once a request begins, all of it comes within
    `read_timeout_s`, so a head dribbled in holds nothing long."""
    deadline.set(KEEP_ALIVE_S, False)
    try:
        first = await reader.readexactly(1)
    except asyncio.IncompleteReadError:
        return None
    deadline.set(limits.read_timeout_s, True)
    request = await _read_rest(reader, first, limits)
    deadline.at = math.inf  # the call has its own deadline
    return request


async def _read_rest(reader: asyncio.StreamReader, first: bytes, limits: Limits) -> Request:
    try:
        head = first + await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError:
        raise Refused(HTTPStatus.BAD_REQUEST, "malformed", "request cut short") from None
    except asyncio.LimitOverrunError:
        raise Refused(HTTPStatus.BAD_REQUEST, "malformed", "request head too long") from None
    lines = head.decode("latin-1").split("\r\n")
    try:
        method, path, version = lines[0].split(" ")
    except ValueError:
        raise Refused(HTTPStatus.BAD_REQUEST, "malformed", f"{lines[0]!r:.200}") from None
    headers = {}
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if sep:
            headers[name.strip().lower()] = value.strip()
    if path.split("?")[0] not in _OPEN_PATHS and not limits.authorized(headers):
        raise Refused(HTTPStatus.UNAUTHORIZED, "unauthorized", "no valid Authorization token")
    if "chunked" in headers.get("transfer-encoding", "").lower():
        raise Refused(HTTPStatus.BAD_REQUEST, "malformed", "chunked bodies are not read")
    length = headers.get("content-length", "0")
    if not (length.isascii() and length.isdigit()):
        raise Refused(HTTPStatus.BAD_REQUEST, "malformed", f"Content-Length {length!r:.50}")
    size = int(length)
    if size > limits.max_body_bytes:
        raise Refused(
            HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
            "malformed",
            f"body of {size} bytes, over --max-body-bytes {limits.max_body_bytes}",
        )
    if size <= _LARGE_BODY_BYTES:
        body = Body(await reader.readexactly(size) if size else b"")
    else:  # read and parsed a few at a time: what a body costs is bounded, not its count
        async with limits.large_bodies:
            body = Body(await reader.readexactly(size))
            body.parse()
    connection = headers.get("connection", "").lower()
    keep_alive = connection != "close" and (version == "HTTP/1.1" or connection == "keep-alive")
    return Request(method, path, headers, body, keep_alive)


def _response(
    status: HTTPStatus, data: bytes, keep_alive: bool, content_type: str = "application/json"
) -> bytes:
    """Head and body in one buffer: one write per reply."""
    close = "" if keep_alive else "Connection: close\r\n"
    head = (
        f"HTTP/1.1 {status.value} {status.phrase}\r\nContent-Type: {content_type}\r\n"
        f"Content-Length: {len(data)}\r\n{close}\r\n"
    )
    return head.encode() + data


def error_body(reason: str, detail: str) -> bytes:
    return json.dumps({"error": reason, "detail": detail}).encode()


class HTTPServer:
    """`app` behind HTTP on a socket bound at construction (so `server_port` is known at once);
    `serve_forever` runs the event loop on the calling thread until `shutdown`."""

    def __init__(
        self, app: App, host: str, port: int, limits: Limits, max_connections: int
    ) -> None:
        self.app = app
        self.limits = limits
        # Past the descriptor limit `accept` fails and asyncio retries it every second: the cap
        # keeps new connections answered (refused) before it comes to that.
        self.max_connections = min(max_connections, _fd_limit() - _SPARE_FDS)
        self.socket = socket.create_server((host, port), backlog=_BACKLOG)
        self.server_port: int = self.socket.getsockname()[1]
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._started = threading.Event()
        self._done = threading.Event()
        self._connections: dict[asyncio.Task[None], tuple[asyncio.StreamWriter, _Deadline]] = {}

    def serve_forever(self) -> None:
        try:
            asyncio.run(self._serve())
        finally:
            self._done.set()

    def shutdown(self) -> None:
        """Stop `serve_forever` (from another thread) and wait for it to return."""
        self._started.wait()
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._done.wait()

    def server_close(self) -> None:
        self.socket.close()

    async def _serve(self) -> None:
        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        if threading.current_thread() is threading.main_thread():
            # SIGTERM (a container stopping) ends the server (and what the app holds) like Ctrl-C.
            self._loop.add_signal_handler(signal.SIGTERM, self._stop.set)
        self.socket.setblocking(False)
        server = asyncio.ensure_future(self._accept())
        self._started.set()
        background = asyncio.ensure_future(self.app.background())
        sweep = asyncio.ensure_future(self._cut_off_slow())
        try:
            await self._stop.wait()
        finally:
            sweep.cancel()
            background.cancel()
            server.cancel()
            await self.app.close_all()
            # Connections end by their own code, not cancelled by `asyncio.run` (which in 3.11
            # logs each cancelled one as an error).
            for writer, _ in self._connections.values():
                writer.close()
            if self._connections:
                await asyncio.wait(self._connections, timeout=_CLOSE_TIMEOUT_S)

    async def _accept(self) -> None:
        """Connections accepted one by one, each served by `_connection`. Not `start_server`:
        out of descriptors, its accept loop retried up to the backlog (4096) times per wakeup,
        a traceback each (4.9 MB of log in 6 s); here it is one try a second, a line a minute."""
        loop = asyncio.get_running_loop()
        out_of_fds = _Throttled(_OUT_OF_FDS_LOG_EVERY_S)
        while True:
            try:
                conn, _ = await loop.sock_accept(self.socket)
            except OSError as exc:
                if exc.errno not in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    raise
                out_of_fds.warn("accept failed: %s; new connections wait", exc)
                await asyncio.sleep(1.0)
                continue
            reader, writer = await asyncio.open_connection(sock=conn, limit=_MAX_HEAD_BYTES)
            deadline = _Deadline()
            task = asyncio.ensure_future(self._connection(reader, writer, deadline))
            self._connections[task] = writer, deadline

    async def _cut_off_slow(self) -> None:
        every = min(1.0, self.limits.read_timeout_s / 2)
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(every)
            now = loop.time()
            for task, (_, deadline) in list(self._connections.items()):
                if deadline.at < now and not deadline.expired:
                    deadline.expired = True
                    task.cancel()

    async def _connection(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, deadline: _Deadline
    ) -> None:
        task = asyncio.current_task()
        assert task is not None
        if len(self._connections) > self.max_connections:
            try:
                await self._turn_away(reader, writer)
            finally:
                writer.close()
                del self._connections[task]
            return
        sock = writer.get_extra_info("socket")
        if sock is not None:
            # A reply is one write, but a delayed ACK must never hold a small one back (with
            # Nagle's algorithm a call took 70 ms instead of 0.5 ms under the threaded server).
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            while True:
                try:
                    request = await _read_request(reader, self.limits, deadline)
                except Refused as exc:  # what follows on the connection cannot be framed
                    writer.write(_response(exc.status, error_body(exc.reason, exc.detail), False))
                    await writer.drain()
                    return
                if request is None:
                    return
                reply = await self.app.answer(request)
                writer.write(
                    _response(reply.status, reply.data, request.keep_alive, reply.content_type)
                )
                deadline.set(self.limits.read_timeout_s, False)  # a client that reads no reply
                await writer.drain()
                if not request.keep_alive:
                    return
        except (ConnectionError, asyncio.IncompleteReadError):
            pass  # the client went away (its timeout, or it stopped): its session stays
        except asyncio.CancelledError:
            if not deadline.expired:
                raise  # the server stops
            task.uncancel()
            if deadline.reading:
                detail = f"request not read in {self.limits.read_timeout_s:g}s"
                writer.write(
                    _response(HTTPStatus.REQUEST_TIMEOUT, error_body("malformed", detail), False)
                )
        finally:
            writer.close()
            del self._connections[task]

    async def _turn_away(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """A 503 for a connection past the cap, then its request read to the end (briefly):
        closed with unread data, the connection would be reset and the reply lost."""
        detail = f"{self.max_connections} connections open (--max-connections)"
        busy = _response(HTTPStatus.SERVICE_UNAVAILABLE, error_body("unavailable", detail), False)
        with contextlib.suppress(OSError, TimeoutError):
            writer.write(busy)
            writer.write_eof()
            async with asyncio.timeout(1.0):
                while await reader.read(_MAX_HEAD_BYTES):
                    pass


def bind(
    app: App,
    host: str,
    port: int,
    token: str | None,
    token_env: str,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    read_timeout_s: float = DEFAULT_READ_TIMEOUT_S,
    max_connections: int = DEFAULT_MAX_CONNECTIONS,
) -> HTTPServer:
    """`app` served on `host:port`, bound; off loopback only with a token (ValueError naming
    `token_env`): nothing beyond this host may reach it unauthenticated."""
    check_host(host, token, token_env)
    limits = Limits(token, max_body_bytes, read_timeout_s)
    return HTTPServer(app, host, port, limits, max_connections)


def _fd_limit() -> int:
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return soft if soft != resource.RLIM_INFINITY else 1 << 20


class _Throttled:
    """A warning logged at most once per `every_s`, with how many were held back."""

    def __init__(self, every_s: float) -> None:
        self._every_s = every_s
        self._last = -math.inf
        self._missed = 0

    def warn(self, msg: str, *args: object) -> None:
        now = time.monotonic()
        if now - self._last < self._every_s:
            self._missed += 1
            return
        log.warning(msg + " (%d more since the last such line)", *args, self._missed)
        self._last, self._missed = now, 0
