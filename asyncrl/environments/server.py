"""`asyncrl env-server`: any `Environment` class behind a small versioned HTTP/JSON protocol,
so that environments run in their own process or container and fail alone.

Protocol version 1 (JSON bodies only; nothing is ever unpickled):

    POST   /v1/sessions               {"item": {prompt_id, prompt, prompt_ids, answer}}
           → 200 {"protocol": 1, "session": id, "observation": obs}
    POST   /v1/sessions/{id}/step     {"response": text}
           → 200 {"observation": obs, "done": bool, "reward": float | null, "info": {...}}
    DELETE /v1/sessions/{id}          → 200 {}          (ends the session; cancels a call in flight)
    GET    /health                    → 200 {"status": "ok", "sessions": n, "max_sessions": m}
    GET    /version                   → 200 {"protocol": 1, "asyncrl": version, "env": path}
    GET    /metrics                   → Prometheus text (`asyncrl_env_server_*`: sessions open,
                                        requests by outcome, call seconds, idle sessions closed)

A step that answers `done: true` ends its session: the server closes the environment after the
reply, so a finished episode costs no DELETE (a fifth of an episode's calls with three turns);
a DELETE after it answers 404 like any unknown session. DELETE is for episodes cut short. A
session no call has used for `--idle-timeout-s` (default 30 min) is closed too: the worker that
held it died without a word (SIGKILL, a lost node), and its sessions must not fill the server.

An error is `{"error": reason, "detail": text}`: 400 for a request that does not fit, 404 for an
unknown session, 401 without the run's token, 413 for a body over `--max-body-bytes`, 500 with
reason `error` when the environment raised (anything, `SystemExit` included: that session fails,
the server goes on) and `malformed` when its reply does not fit `StepResult` or JSON, 500 with
`timeout` when a call outlived the deadline its client sent (`X-Asyncrl-Timeout-S`: the call is
cancelled and its session ended, since the client has given up on it), 503 with `unavailable`
when `--max-sessions` sessions or `--max-connections` connections are open. Each session is one
instance of the class (`Class(**kwargs)`).

Authentication: a shared secret per run, read from the environment variable `--token-env`
(default `ASYNCRL_ENV_SERVER_TOKEN`) or `--token-file`; every request but `/health` and
`/metrics` (probes, scrapes) must carry `Authorization: Bearer <token>`. Without a token the
server binds to loopback only. A request must arrive whole within `--read-timeout-s` of its
first byte; a connection idle for `KEEP_ALIVE_S` is closed.

One asyncio event loop does everything: it accepts connections, reads requests (HTTP/1.1,
keep-alive, `Content-Length` bodies; enough for the worker's client and httpx, not a general
server) and runs the environments' coroutines, so a waiting session costs a timer, not a thread. An
environment that blocks the loop stalls every session of the server (`Environment` says to
move blocking work to a thread).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import errno
import hmac
import ipaddress
import json
import logging
import math
import os
import resource
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from http import HTTPStatus
from typing import IO, Any

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from asyncrl import __version__
from asyncrl.environments.base import (
    EnvironmentFailure,
    check_observation,
    check_step,
    contained,
    malformed,
)
from asyncrl.environments.local import check_class
from asyncrl.httpserve import serve_until_interrupted
from asyncrl.metrics.roles import REGISTRY, RoleMetrics
from asyncrl.reasons import ENV_REASONS

log = logging.getLogger(__name__)

PROTOCOL = 1
TOKEN_ENV = "ASYNCRL_ENV_SERVER_TOKEN"
# The client's deadline for one call, in seconds: past it the server cancels the call.
TIMEOUT_HEADER = "x-asyncrl-timeout-s"
# A pooled connection idle for this long is closed; clients reuse one only well within it.
KEEP_ALIVE_S = 120.0
_DETAIL_CHARS = 2000
_MAX_HEAD_BYTES = 64 << 10
# Bodies above this size are read and parsed a few at a time, so memory stays a small multiple
# of `--max-body-bytes` however many clients send one at once.
_LARGE_BODY_BYTES = 256 << 10
_LARGE_BODIES_AT_ONCE = 2
# A worker opens many sessions at once (a batch of prompts × n): a short backlog would reset
# connections in such a burst.
_BACKLOG = 4096
_CLOSE_TIMEOUT_S = 5.0
# Descriptors kept for the server's own files, the listening socket and the environments.
_SPARE_FDS = 64
_OUT_OF_FDS_LOG_EVERY_S = 60.0
DEFAULT_MAX_BODY_BYTES = 4 << 20
DEFAULT_MAX_CONNECTIONS = 4096
DEFAULT_READ_TIMEOUT_S = 30.0


class _Refused(Exception):
    def __init__(self, status: HTTPStatus, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.status, self.reason, self.detail = status, reason, detail


async def _contained(start: Callable[[], Awaitable[Any]]) -> Any:
    """A call of user code whatever it raises (`contained` keeps SystemExit and the like inside
    it) as that call's `EnvironmentFailure`; a cancellation by the server (a close, a deadline,
    shutdown) passes."""

    async def call() -> Any:
        return await start()

    try:
        return await contained(call())
    except EnvironmentFailure:
        raise
    except Exception:
        raise EnvironmentFailure("error", _trace()) from None


def _trace() -> str:
    return traceback.format_exc()[-_DETAIL_CHARS:]


class EnvServer:
    """The sessions of one environment class; its methods run on the server's event loop."""

    def __init__(
        self,
        path: str,
        kwargs: dict[str, Any],
        max_sessions: int,
        python_path: Sequence[str],
        idle_timeout_s: float = 0.0,
    ) -> None:
        self.path = path
        self._cls = check_class(path, python_path, kwargs)
        self._kwargs = kwargs
        self.max_sessions = max_sessions
        self.idle_timeout_s = idle_timeout_s
        self.metrics = RoleMetrics("env-server", socket.gethostname())
        self.metrics.env_server_sessions.set_function(lambda: len(self._sessions))
        self._sessions: dict[str, Any] = {}
        # session → loop time its last call started or ended: a call running longer than the
        # idle timeout is as good as gone (its worker died mid-call) and is closed too.
        self._used: dict[str, float] = {}
        self._calls: dict[str, asyncio.Task[Any]] = {}
        self._ending: set[asyncio.Task[None]] = set()  # finished episodes' closes

    @property
    def sessions(self) -> int:
        return len(self._sessions)

    async def create(self, body: dict[str, Any], deadline: float | None = None) -> dict[str, Any]:
        item = _prompt_item(body.get("item"))
        if len(self._sessions) >= self.max_sessions:
            raise _Refused(
                HTTPStatus.SERVICE_UNAVAILABLE, "unavailable", f"{self.max_sessions} open"
            )
        session = uuid.uuid4().hex
        self._sessions[session] = None  # counted while the constructor and reset run
        try:
            env = await _contained(self._construct)
            if session not in self._sessions:  # closed meanwhile (shutdown)
                raise EnvironmentFailure("error", "cancelled: the session was closed")
            self._sessions[session] = env
            obs = check_observation(await self._run(session, lambda: env.reset(item), deadline))
        except BaseException:
            self._end(session)
            raise
        return {"protocol": PROTOCOL, "session": session, "observation": obs}

    async def _construct(self) -> Any:
        return self._cls(**self._kwargs)

    async def step(
        self, session: str, body: dict[str, Any], deadline: float | None = None
    ) -> dict[str, Any]:
        response = body.get("response")
        if not isinstance(response, str):
            raise _Refused(HTTPStatus.BAD_REQUEST, "malformed", "body needs a `response` string")
        env = self._env(session)
        try:
            result = check_step(await self._run(session, lambda: env.step(response), deadline))
        except EnvironmentFailure as exc:
            if exc.reason == "timeout":  # the client has given up on the episode
                self._end(session)
            raise
        if result.done:
            self._end(session)
        return {
            "observation": result.observation,
            "done": result.done,
            "reward": None if result.reward is None else float(result.reward),
            "info": result.info,
        }

    async def close(self, session: str) -> dict[str, Any]:
        env = self._env(session)
        call = self._calls.get(session)
        if call is not None:  # a step the client gave up on (its timeout) ends here
            call.cancel()
        try:
            await self._run(session, env.close, _CLOSE_TIMEOUT_S)
        finally:
            self._sessions.pop(session, None)
            self._used.pop(session, None)
        return {}

    async def close_idle(self) -> int:
        """Close the sessions no call has started or ended in for `idle_timeout_s` — a call
        still running then is hung, its worker gone — ; how many."""
        since = asyncio.get_running_loop().time() - self.idle_timeout_s
        idle = [s for s, t in self._used.items() if t < since]
        self.metrics.env_server_sessions_closed_idle.inc(len(idle))
        results = await asyncio.gather(*(self.close(s) for s in idle), return_exceptions=True)
        for session, result in zip(idle, results, strict=True):
            if isinstance(result, BaseException):
                log.warning("closing idle session %s: %s", session, result)
        return len(idle)

    def _end(self, session: str) -> None:
        """A session over (its episode finished, or its call failed or outlived its deadline):
        gone now, its environment closed in the background (a slow teardown does not hold the
        reply back)."""
        env = self._sessions.pop(session, None)
        self._used.pop(session, None)
        call = self._calls.get(session)
        if call is not None:
            call.cancel()
        if env is not None:
            task = asyncio.ensure_future(self._close_finished(session, env))
            self._ending.add(task)
            task.add_done_callback(self._ending.discard)

    @staticmethod
    async def _close_finished(session: str, env: Any) -> None:
        try:
            async with asyncio.timeout(_CLOSE_TIMEOUT_S):
                await _contained(env.close)
        except (EnvironmentFailure, TimeoutError) as exc:  # the episode is over and answered
            log.warning("closing ended session %s failed: %.200s", session, exc)

    async def close_all(self) -> None:
        """At shutdown: every open session closed, best effort within a few seconds."""
        closing: list[asyncio.Future[Any]] = [
            asyncio.ensure_future(self.close(s))
            for s, env in list(self._sessions.items())
            if env is not None
        ]
        closing += self._ending
        if closing:
            _, stuck = await asyncio.wait(closing, timeout=_CLOSE_TIMEOUT_S)
            for task in stuck:
                task.cancel()
            await asyncio.gather(*closing, return_exceptions=True)

    def _env(self, session: str) -> Any:
        env = self._sessions.get(session)
        if env is None:
            raise _Refused(HTTPStatus.NOT_FOUND, "unavailable", f"no session {session!r}")
        return env

    async def _run(
        self, session: str, start: Callable[[], Awaitable[Any]], deadline: float | None
    ) -> Any:
        """The environment's call as a task `close` can cancel, cancelled past `deadline`
        seconds (a bare timer handle, lighter than an `asyncio.timeout` context per call);
        its failure as an `EnvironmentFailure`."""
        task = asyncio.ensure_future(_contained(start))
        self._calls[session] = task
        loop = asyncio.get_running_loop()
        started = self._used[session] = loop.time()
        expired: list[bool] = []
        timer = None
        if deadline is not None:
            timer = loop.call_later(deadline, lambda: expired.append(task.cancel()))
        try:
            return await task
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if current is not None and current.cancelling():
                raise  # this request itself is cancelled (the server stops)
            if expired:
                detail = f"no reply in {deadline:g}s: the call was cancelled"
                raise EnvironmentFailure("timeout", detail) from None
            raise EnvironmentFailure("error", "cancelled: the session was closed") from None
        finally:
            if timer is not None:
                timer.cancel()
            if self._calls.get(session) is task:
                del self._calls[session]
            now = loop.time()
            self.metrics.env_server_call_seconds.observe(now - started)
            if session in self._sessions:
                self._used[session] = now


def _prompt_item(raw: object) -> Any:
    """The `item` of a create request, every field of its exact JSON type."""
    from asyncrl.items import PromptItem

    if not isinstance(raw, dict):
        raise _Refused(HTTPStatus.BAD_REQUEST, "malformed", "body needs an `item` object")
    prompt_id, prompt, ids = raw.get("prompt_id"), raw.get("prompt"), raw.get("prompt_ids")
    if not (isinstance(prompt_id, str) and isinstance(prompt, str) and isinstance(ids, list)):
        raise _Refused(
            HTTPStatus.BAD_REQUEST, "malformed", "item needs prompt_id, prompt and prompt_ids"
        )
    if not all(type(t) is int and 0 <= t < 1 << 32 for t in ids):
        raise _Refused(
            HTTPStatus.BAD_REQUEST, "malformed", "prompt_ids are not all integers in [0, 2^32)"
        )
    return PromptItem(prompt_id=prompt_id, prompt=prompt, prompt_ids=ids, answer=raw.get("answer"))


class _Body:
    """A request body, parsed once as a JSON object (the bytes dropped then)."""

    def __init__(self, data: bytes) -> None:
        self._data: bytes | None = data
        self._parsed: dict[str, Any] | _Refused | None = None

    def parse(self) -> None:
        if self._data is None:
            return
        data, self._data = self._data, None
        try:
            body = json.loads(data or b"{}")
        except (ValueError, RecursionError) as exc:
            self._parsed = _Refused(HTTPStatus.BAD_REQUEST, "malformed", f"not JSON: {exc}")
            return
        if not isinstance(body, dict):
            self._parsed = _Refused(HTTPStatus.BAD_REQUEST, "malformed", "body is not an object")
            return
        self._parsed = body

    def json(self) -> dict[str, Any]:
        self.parse()
        if isinstance(self._parsed, _Refused):
            raise self._parsed
        assert self._parsed is not None
        return self._parsed


class _Request:
    def __init__(
        self, method: str, path: str, headers: dict[str, str], body: _Body, keep_alive: bool
    ) -> None:
        self.method, self.path, self.headers = method, path, headers
        self.body, self.keep_alive = body, keep_alive

    def json(self) -> dict[str, Any]:
        return self.body.json()

    def deadline(self) -> float | None:
        """The client's deadline for this call, in seconds; None when it sent none."""
        value = self.headers.get(TIMEOUT_HEADER)
        if value is None:
            return None
        try:
            seconds = float(value)
        except ValueError:
            seconds = math.nan
        if not 0 < seconds < math.inf:
            raise _Refused(HTTPStatus.BAD_REQUEST, "malformed", f"{TIMEOUT_HEADER}: {value!r:.50}")
        return seconds


class _Limits:
    """What one request may cost the server: a shared secret, a body size, read deadlines."""

    def __init__(self, token: str | None, max_body_bytes: int, read_timeout_s: float) -> None:
        self.token = f"Bearer {token}".encode() if token else None
        self.max_body_bytes = max_body_bytes
        self.read_timeout_s = read_timeout_s
        self.large_bodies = asyncio.Semaphore(_LARGE_BODIES_AT_ONCE)

    def authorized(self, headers: dict[str, str]) -> bool:
        if self.token is None:
            return True
        return hmac.compare_digest(headers.get("authorization", "").encode(), self.token)


_OPEN_PATHS = ("/health", "/metrics")  # probes and scrapes: no session, no token


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
    reader: asyncio.StreamReader, limits: _Limits, deadline: _Deadline
) -> _Request | None:
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


async def _read_rest(reader: asyncio.StreamReader, first: bytes, limits: _Limits) -> _Request:
    try:
        head = first + await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError:
        raise _Refused(HTTPStatus.BAD_REQUEST, "malformed", "request cut short") from None
    except asyncio.LimitOverrunError:
        raise _Refused(HTTPStatus.BAD_REQUEST, "malformed", "request head too long") from None
    lines = head.decode("latin-1").split("\r\n")
    try:
        method, path, version = lines[0].split(" ")
    except ValueError:
        raise _Refused(HTTPStatus.BAD_REQUEST, "malformed", f"{lines[0]!r:.200}") from None
    headers = {}
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if sep:
            headers[name.strip().lower()] = value.strip()
    if path.split("?")[0] not in _OPEN_PATHS and not limits.authorized(headers):
        raise _Refused(HTTPStatus.UNAUTHORIZED, "unauthorized", "no valid Authorization token")
    if "chunked" in headers.get("transfer-encoding", "").lower():
        raise _Refused(HTTPStatus.BAD_REQUEST, "malformed", "chunked bodies are not read")
    length = headers.get("content-length", "0")
    if not (length.isascii() and length.isdigit()):
        raise _Refused(HTTPStatus.BAD_REQUEST, "malformed", f"Content-Length {length!r:.50}")
    size = int(length)
    if size > limits.max_body_bytes:
        raise _Refused(
            HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
            "malformed",
            f"body of {size} bytes, over --max-body-bytes {limits.max_body_bytes}",
        )
    if size <= _LARGE_BODY_BYTES:
        body = _Body(await reader.readexactly(size) if size else b"")
    else:  # read and parsed a few at a time: what a body costs is bounded, not its count
        async with limits.large_bodies:
            body = _Body(await reader.readexactly(size))
            body.parse()
    connection = headers.get("connection", "").lower()
    keep_alive = connection != "close" and (version == "HTTP/1.1" or connection == "keep-alive")
    return _Request(method, path, headers, body, keep_alive)


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


def _error(reason: str, detail: str) -> bytes:
    return json.dumps({"error": reason, "detail": detail}).encode()


class EnvHTTPServer:
    """`EnvServer` behind HTTP on a socket bound at construction (so `server_port` is known at
    once); `serve_forever` runs the event loop on the calling thread until `shutdown`."""

    def __init__(
        self, env: EnvServer, host: str, port: int, limits: _Limits, max_connections: int
    ) -> None:
        self.env = env
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
            # SIGTERM (a container stopping) closes the sessions like Ctrl-C does.
            self._loop.add_signal_handler(signal.SIGTERM, self._stop.set)
        self.socket.setblocking(False)
        server = asyncio.ensure_future(self._accept())
        self._started.set()
        reaper = asyncio.ensure_future(self._close_idle()) if self.env.idle_timeout_s > 0 else None
        sweep = asyncio.ensure_future(self._cut_off_slow())
        try:
            await self._stop.wait()
        finally:
            sweep.cancel()
            if reaper is not None:
                reaper.cancel()
            server.cancel()
            await self.env.close_all()
            # Connections end by their own code, not cancelled by `asyncio.run` (which in 3.11
            # logs each cancelled one as an error).
            for writer, _ in self._connections.values():
                writer.close()
            if self._connections:
                await asyncio.wait(self._connections, timeout=_CLOSE_TIMEOUT_S)

    async def _close_idle(self) -> None:
        # Looked for a few times per timeout: a session outlives it by at most a quarter.
        every = min(self.env.idle_timeout_s / 4, 60.0)
        while True:
            await asyncio.sleep(every)
            closed = await self.env.close_idle()
            if closed:
                log.warning(
                    "closed %d session(s) no call used for %gs (their workers are gone?)",
                    closed,
                    self.env.idle_timeout_s,
                )

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
                except _Refused as exc:  # what follows on the connection cannot be framed
                    writer.write(_response(exc.status, _error(exc.reason, exc.detail), False))
                    await writer.drain()
                    return
                if request is None:
                    return
                if request.method == "GET" and request.path.split("?")[0] == "/metrics":
                    metrics = generate_latest(REGISTRY)
                    writer.write(
                        _response(HTTPStatus.OK, metrics, request.keep_alive, CONTENT_TYPE_LATEST)
                    )
                else:
                    status, reply = await self._answer(request)
                    writer.write(_response(status, reply, request.keep_alive))
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
                    _response(HTTPStatus.REQUEST_TIMEOUT, _error("malformed", detail), False)
                )
        finally:
            writer.close()
            del self._connections[task]

    async def _turn_away(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """A 503 for a connection past the cap, then its request read to the end (briefly):
        closed with unread data, the connection would be reset and the reply lost."""
        detail = f"{self.max_connections} connections open (--max-connections)"
        busy = _response(HTTPStatus.SERVICE_UNAVAILABLE, _error("unavailable", detail), False)
        with contextlib.suppress(OSError, TimeoutError):
            writer.write(busy)
            writer.write_eof()
            async with asyncio.timeout(1.0):
                while await reader.read(_MAX_HEAD_BYTES):
                    pass

    async def _answer(self, request: _Request) -> tuple[HTTPStatus, bytes]:
        env = self.env
        parts = request.path.split("?")[0].strip("/").split("/")
        try:
            reply: dict[str, Any]
            if request.method == "GET" and parts == ["health"]:
                reply = {"status": "ok", "sessions": env.sessions, "max_sessions": env.max_sessions}
            elif request.method == "GET" and parts == ["version"]:
                reply = {"protocol": PROTOCOL, "asyncrl": __version__, "env": env.path}
            elif parts[:2] != ["v1", "sessions"]:
                raise _Refused(HTTPStatus.NOT_FOUND, "malformed", request.path)
            elif request.method == "POST" and len(parts) == 2:
                reply = await env.create(request.json(), request.deadline())
            elif request.method == "POST" and len(parts) == 4 and parts[3] == "step":
                reply = await env.step(parts[2], request.json(), request.deadline())
            elif request.method == "DELETE" and len(parts) == 3:
                reply = await env.close(parts[2])
            else:
                what = f"{request.method} {request.path}"
                raise _Refused(HTTPStatus.NOT_FOUND, "malformed", what)
            data = json.dumps(reply).encode()  # info the environment filled may not be JSON
            answer, outcome = (HTTPStatus.OK, data), "ok"
        except _Refused as exc:
            answer, outcome = (exc.status, _error(exc.reason, exc.detail)), "refused"
        except EnvironmentFailure as exc:
            answer = HTTPStatus.INTERNAL_SERVER_ERROR, _error(exc.reason, exc.detail)
            outcome = exc.reason if exc.reason in ENV_REASONS else "error"
        except (TypeError, ValueError, RecursionError) as exc:
            # An info the environment filled that JSON cannot hold (an object, nesting deeper
            # than `json.dumps` goes): that call fails with a reply, the connection stays.
            failure = malformed(f"reply is not JSON: {exc!r:.500}")
            answer = HTTPStatus.INTERNAL_SERVER_ERROR, _error(failure.reason, failure.detail)
            outcome = failure.reason
        except Exception as exc:  # the server's own bug: still a reply, never a dropped call
            log.warning("%s %s failed", request.method, request.path, exc_info=True)
            answer = HTTPStatus.INTERNAL_SERVER_ERROR, _error("error", f"server: {exc!r:.500}")
            outcome = "error"
        if parts[:2] == ["v1", "sessions"]:
            env.metrics.env_server_requests[outcome].inc()
        return answer


def make_server(
    path: str,
    kwargs: dict[str, Any],
    host: str = "127.0.0.1",
    port: int = 0,
    max_sessions: int = 1024,
    python_path: Sequence[str] = (),
    idle_timeout_s: float = 0.0,
    token: str | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    max_connections: int = DEFAULT_MAX_CONNECTIONS,
    read_timeout_s: float = DEFAULT_READ_TIMEOUT_S,
) -> EnvHTTPServer:
    """The server of `path` (checked first: ValueError with a one-line reason), bound. Without
    `token` it serves loopback only: nothing beyond this host may reach it unauthenticated."""
    if not token and not _loopback(host):
        raise ValueError(
            f"--host {host} without a token: set ${TOKEN_ENV} (or --token-env/--token-file) "
            "to a secret shared by the run, or bind to 127.0.0.1"
        )
    env = EnvServer(path, kwargs, max_sessions, python_path, idle_timeout_s)
    limits = _Limits(token, max_body_bytes, read_timeout_s)
    return EnvHTTPServer(env, host, port, limits, max_connections)


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


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


def spawn(
    env: str, *args: str, environ: Mapping[str, str] | None = None, quiet: bool = False
) -> tuple[subprocess.Popen[str], str]:
    """`asyncrl env-server --env ENV --port 0 ARGS` in a child process of this Python, once it
    listens: (the process, its URL). `environ`: the child's environment (default: this one's);
    `quiet` drops its log. RuntimeError with its first line when it does not start."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "asyncrl", "env-server", "--env", env, "--port", "0", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL if quiet else None,
        text=True,
        env=dict(environ) if environ is not None else None,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if "listening on" not in line:
        proc.kill()
        proc.wait()
        raise RuntimeError(f"asyncrl env-server --env {env} did not start: {line!r}")
    # What the environments print must go somewhere: a full pipe would stop the server.
    sink = None if quiet else sys.stdout
    threading.Thread(target=_drain, args=(proc.stdout, sink), daemon=True).start()
    return proc, line.split()[-1]


def _drain(source: IO[str], sink: IO[str] | None) -> None:
    for line in source:
        if sink is not None:
            sink.write(line)


def read_token(token_file: str | os.PathLike[str] | None, token_env: str) -> str | None:
    """The run's env-server token: the file's content when given (a mounted Secret), else the
    environment variable's; None when neither holds one. OSError for an unreadable file."""
    if token_file is not None:
        with open(token_file) as f:
            return f.read().strip() or None
    return os.environ.get(token_env) or None


def main(args: argparse.Namespace) -> int:
    """`asyncrl env-server`: a bad option is one line on stderr and exit 2, before binding."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    try:
        kwargs = json.loads(args.kwargs)
        if not isinstance(kwargs, dict):
            raise ValueError("not a JSON object")
        if args.max_sessions < 1:
            raise ValueError("--max-sessions: must be at least 1")
        if not args.idle_timeout_s >= 0:  # NaN too
            raise ValueError("--idle-timeout-s: must be 0 (never) or more")
        if args.max_body_bytes < 1 or args.max_connections < 1:
            raise ValueError("--max-body-bytes and --max-connections: must be at least 1")
        if not 0 < args.read_timeout_s < math.inf:
            raise ValueError("--read-timeout-s: must be a positive number of seconds")
        try:
            token = read_token(args.token_file, args.token_env)
        except OSError as exc:
            raise ValueError(f"--token-file {args.token_file}: {exc.strerror}") from None
        httpd = make_server(
            args.env,
            kwargs,
            args.host,
            args.port,
            args.max_sessions,
            [os.path.abspath(d) for d in args.python_path],
            args.idle_timeout_s,
            token,
            args.max_body_bytes,
            args.max_connections,
            args.read_timeout_s,
        )
    except (ValueError, OSError) as exc:  # OSError: the port is taken
        print(f"asyncrl env-server: {exc}", file=sys.stderr)
        return 2
    return serve_until_interrupted("env-server", args.host, httpd)
