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
unknown session, 500 with reason `error` when the environment raised and `malformed` when its
reply does not fit `StepResult`, 503 with `unavailable` when `--max-sessions` are open. Each
session is one instance of the class (`Class(**kwargs)`). Binds to loopback unless told
otherwise: there is no auth.

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
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import traceback
import uuid
from collections.abc import Coroutine, Mapping, Sequence
from http import HTTPStatus
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from asyncrl import __version__
from asyncrl.environments.base import (
    EnvironmentFailure,
    check_observation,
    check_step,
    malformed,
)
from asyncrl.environments.local import check_class
from asyncrl.metrics.roles import REGISTRY, RoleMetrics
from asyncrl.reasons import ENV_REASONS

log = logging.getLogger(__name__)

PROTOCOL = 1
_DETAIL_CHARS = 2000
_MAX_BODY_BYTES = 64 << 20
_MAX_HEAD_BYTES = 64 << 10
# A worker opens many sessions at once (a batch of prompts × n): a short backlog would reset
# connections in such a burst.
_BACKLOG = 4096
_CLOSE_TIMEOUT_S = 5.0


class _Refused(Exception):
    def __init__(self, status: HTTPStatus, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.status, self.reason, self.detail = status, reason, detail


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
        self._used: dict[str, float] = {}  # session → loop time its last call ended
        self._calls: dict[str, asyncio.Task[Any]] = {}
        self._ending: set[asyncio.Task[None]] = set()  # finished episodes' closes

    @property
    def sessions(self) -> int:
        return len(self._sessions)

    async def create(self, body: dict[str, Any]) -> dict[str, Any]:
        from asyncrl.items import PromptItem

        raw = body.get("item")
        if not isinstance(raw, dict):
            raise _Refused(HTTPStatus.BAD_REQUEST, "malformed", "body needs an `item` object")
        try:
            item = PromptItem(
                prompt_id=str(raw["prompt_id"]),
                prompt=str(raw["prompt"]),
                prompt_ids=[int(t) for t in raw["prompt_ids"]],
                answer=raw.get("answer"),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise _Refused(HTTPStatus.BAD_REQUEST, "malformed", f"bad item: {exc!r}") from None
        if len(self._sessions) >= self.max_sessions:
            raise _Refused(
                HTTPStatus.SERVICE_UNAVAILABLE, "unavailable", f"{self.max_sessions} open"
            )
        session = uuid.uuid4().hex
        try:
            self._sessions[session] = env = self._cls(**self._kwargs)
            obs = check_observation(await self._run(session, env.reset(item)))
        except BaseException:
            self._sessions.pop(session, None)
            self._used.pop(session, None)
            raise
        return {"protocol": PROTOCOL, "session": session, "observation": obs}

    async def step(self, session: str, body: dict[str, Any]) -> dict[str, Any]:
        response = body.get("response")
        if not isinstance(response, str):
            raise _Refused(HTTPStatus.BAD_REQUEST, "malformed", "body needs a `response` string")
        result = check_step(await self._run(session, self._env(session).step(response)))
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
            await self._run(session, env.close())
        finally:
            self._sessions.pop(session, None)
            self._used.pop(session, None)
        return {}

    async def close_idle(self) -> int:
        """Close the sessions no call has used for `idle_timeout_s`; how many."""
        since = asyncio.get_running_loop().time() - self.idle_timeout_s
        idle = [s for s, t in self._used.items() if t < since and s not in self._calls]
        self.metrics.env_server_sessions_closed_idle.inc(len(idle))
        results = await asyncio.gather(*(self.close(s) for s in idle), return_exceptions=True)
        for session, result in zip(idle, results, strict=True):
            if isinstance(result, BaseException):
                log.warning("closing idle session %s: %s", session, result)
        return len(idle)

    def _end(self, session: str) -> None:
        """A finished episode's session: gone now, its environment closed in the background
        (a slow teardown does not hold the reply back)."""
        env = self._sessions.pop(session, None)
        self._used.pop(session, None)
        if env is not None:
            task = asyncio.ensure_future(self._close_finished(session, env))
            self._ending.add(task)
            task.add_done_callback(self._ending.discard)

    @staticmethod
    async def _close_finished(session: str, env: Any) -> None:
        try:
            await env.close()
        except Exception:  # the episode is over and answered: nothing to fail any more
            log.warning("closing finished session %s failed", session, exc_info=True)

    async def close_all(self) -> None:
        """At shutdown: every open session closed, best effort within a few seconds."""
        closing: list[asyncio.Future[Any]] = [
            asyncio.ensure_future(self.close(s)) for s in list(self._sessions)
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

    async def _run(self, session: str, call: Coroutine[Any, Any, Any]) -> Any:
        """The environment's coroutine as a task `close` can cancel; its failure as an
        `EnvironmentFailure`."""
        task = asyncio.ensure_future(call)
        self._calls[session] = task
        started = asyncio.get_running_loop().time()
        try:
            return await task
        except EnvironmentFailure:
            raise
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if task.cancelled() and not (current is not None and current.cancelling()):
                raise EnvironmentFailure("error", "cancelled: the session was closed") from None
            raise  # this request itself is cancelled (the server stops)
        except Exception:
            raise EnvironmentFailure("error", traceback.format_exc()[-_DETAIL_CHARS:]) from None
        finally:
            if self._calls.get(session) is task:
                del self._calls[session]
            now = asyncio.get_running_loop().time()
            self.metrics.env_server_call_seconds.observe(now - started)
            if session in self._sessions:
                self._used[session] = now


class _Request:
    def __init__(self, method: str, path: str, body: bytes, keep_alive: bool) -> None:
        self.method, self.path, self.body, self.keep_alive = method, path, body, keep_alive

    def json(self) -> dict[str, Any]:
        try:
            body = json.loads(self.body or b"{}")
        except ValueError as exc:
            raise _Refused(HTTPStatus.BAD_REQUEST, "malformed", f"not JSON: {exc}") from None
        if not isinstance(body, dict):
            raise _Refused(HTTPStatus.BAD_REQUEST, "malformed", "body is not an object")
        return body


async def _read_request(reader: asyncio.StreamReader) -> _Request | None:
    """The next request of a connection; None when the client closed it between requests."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError as exc:
        if not exc.partial:
            return None
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
            headers[name.strip().lower()] = value.strip().lower()
    if "chunked" in headers.get("transfer-encoding", ""):
        raise _Refused(HTTPStatus.BAD_REQUEST, "malformed", "chunked bodies are not read")
    try:
        length = int(headers.get("content-length", "0"))
    except ValueError:
        raise _Refused(HTTPStatus.BAD_REQUEST, "malformed", "bad Content-Length") from None
    if not 0 <= length <= _MAX_BODY_BYTES:
        raise _Refused(HTTPStatus.BAD_REQUEST, "malformed", f"body of {length} bytes")
    body = await reader.readexactly(length) if length else b""
    connection = headers.get("connection", "")
    keep_alive = connection != "close" and (version == "HTTP/1.1" or connection == "keep-alive")
    return _Request(method, path, body, keep_alive)


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

    def __init__(self, env: EnvServer, host: str, port: int) -> None:
        self.env = env
        self.socket = socket.create_server((host, port), backlog=_BACKLOG)
        self.server_port: int = self.socket.getsockname()[1]
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._started = threading.Event()
        self._done = threading.Event()
        self._connections: dict[asyncio.Task[None], asyncio.StreamWriter] = {}

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
        server = await asyncio.start_server(
            # asyncio listens again on the socket, with a backlog of 100 unless told.
            self._connection,
            sock=self.socket,
            backlog=_BACKLOG,
            limit=_MAX_HEAD_BYTES,
        )
        self._started.set()
        reaper = asyncio.ensure_future(self._close_idle()) if self.env.idle_timeout_s > 0 else None
        try:
            await self._stop.wait()
        finally:
            if reaper is not None:
                reaper.cancel()
            server.close()
            await self.env.close_all()
            # Connections end by their own code, not cancelled by `asyncio.run` (which in 3.11
            # logs each cancelled one as an error).
            for writer in self._connections.values():
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

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._connections[task] = writer
        sock = writer.get_extra_info("socket")
        if sock is not None:
            # A reply is one write, but a delayed ACK must never hold a small one back (with
            # Nagle's algorithm a call took 70 ms instead of 0.5 ms under the threaded server).
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            while True:
                try:
                    request = await _read_request(reader)
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
                await writer.drain()
                if not request.keep_alive:
                    return
        except (ConnectionError, asyncio.IncompleteReadError):
            pass  # the client went away (its timeout, or it stopped): its session stays
        finally:
            writer.close()
            del self._connections[task]

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
                reply = await env.create(request.json())
            elif request.method == "POST" and len(parts) == 4 and parts[3] == "step":
                reply = await env.step(parts[2], request.json())
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
        except (TypeError, ValueError) as exc:
            failure = malformed(f"reply is not JSON: {exc}")
            answer = HTTPStatus.INTERNAL_SERVER_ERROR, _error(failure.reason, failure.detail)
            outcome = failure.reason
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
) -> EnvHTTPServer:
    """The server of `path` (checked first: ValueError with a one-line reason), bound."""
    env = EnvServer(path, kwargs, max_sessions, python_path, idle_timeout_s)
    return EnvHTTPServer(env, host, port)


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
    return proc, line.split()[-1]


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
        httpd = make_server(
            args.env,
            kwargs,
            args.host,
            args.port,
            args.max_sessions,
            [os.path.abspath(d) for d in args.python_path],
            args.idle_timeout_s,
        )
    except (ValueError, OSError) as exc:  # OSError: the port is taken
        print(f"asyncrl env-server: {exc}", file=sys.stderr)
        return 2
    # One line on stdout, flushed: how a parent that asked for port 0 learns the port.
    print(f"asyncrl env-server: listening on http://{args.host}:{httpd.server_port}", flush=True)
    try:
        with contextlib.suppress(KeyboardInterrupt):
            httpd.serve_forever()
    finally:
        httpd.server_close()
    return 0
