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

An error is `{"error": reason, "detail": text}`: 400 for a request that does not fit, 404 for an
unknown session, 500 with reason `error` when the environment raised and `malformed` when its
reply does not fit `StepResult`, 503 with `unavailable` when `--max-sessions` are open. Each
session is one instance of the class (`Class(**kwargs)`); its coroutines run on one event loop,
request threads wait on them. Binds to loopback unless told otherwise: there is no auth.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import json
import logging
import os
import sys
import threading
import traceback
import uuid
from collections.abc import Coroutine, Sequence
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from asyncrl import __version__
from asyncrl.environments.base import (
    EnvironmentFailure,
    check_observation,
    check_step,
    malformed,
)
from asyncrl.environments.local import check_class

log = logging.getLogger(__name__)

PROTOCOL = 1
_DETAIL_CHARS = 2000
_MAX_BODY_BYTES = 64 << 20


class _Refused(Exception):
    def __init__(self, status: HTTPStatus, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.status, self.reason, self.detail = status, reason, detail


class EnvServer:
    """The sessions of one environment class and the loop their coroutines run on."""

    def __init__(
        self, path: str, kwargs: dict[str, Any], max_sessions: int, python_path: Sequence[str]
    ) -> None:
        self.path = path
        self._cls = check_class(path, python_path, kwargs)
        self._kwargs = kwargs
        self.max_sessions = max_sessions
        self._sessions: dict[str, Any] = {}
        self._calls: dict[str, concurrent.futures.Future[Any]] = {}
        self._lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        threading.Thread(target=self._loop.run_forever, name="env-loop", daemon=True).start()

    @property
    def sessions(self) -> int:
        return len(self._sessions)

    def create(self, body: dict[str, Any]) -> dict[str, Any]:
        from asyncrl.tasks.base import PromptItem

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
        with self._lock:
            if len(self._sessions) >= self.max_sessions:
                raise _Refused(
                    HTTPStatus.SERVICE_UNAVAILABLE, "unavailable", f"{self.max_sessions} open"
                )
            session = uuid.uuid4().hex
            self._sessions[session] = env = self._cls(**self._kwargs)
        try:
            obs = check_observation(self._run(session, env.reset(item)))
        except BaseException:
            self._drop(session)
            raise
        return {"protocol": PROTOCOL, "session": session, "observation": obs}

    def step(self, session: str, body: dict[str, Any]) -> dict[str, Any]:
        response = body.get("response")
        if not isinstance(response, str):
            raise _Refused(HTTPStatus.BAD_REQUEST, "malformed", "body needs a `response` string")
        result = check_step(self._run(session, self._env(session).step(response)))
        return {
            "observation": result.observation,
            "done": result.done,
            "reward": None if result.reward is None else float(result.reward),
            "info": result.info,
        }

    def close(self, session: str) -> dict[str, Any]:
        env = self._env(session)
        call = self._calls.get(session)
        if call is not None:  # a step the client gave up on (its timeout) ends here
            call.cancel()
        try:
            self._run(session, env.close())
        finally:
            self._drop(session)
        return {}

    def _env(self, session: str) -> Any:
        env = self._sessions.get(session)
        if env is None:
            raise _Refused(HTTPStatus.NOT_FOUND, "unavailable", f"no session {session!r}")
        return env

    def _drop(self, session: str) -> None:
        with self._lock:
            self._sessions.pop(session, None)

    def _run(self, session: str, call: Coroutine[Any, Any, Any]) -> Any:
        """The environment's coroutine on the loop; its failure as an `EnvironmentFailure`."""
        future = asyncio.run_coroutine_threadsafe(call, self._loop)
        self._calls[session] = future
        try:
            return future.result()
        except EnvironmentFailure:
            raise
        except concurrent.futures.CancelledError:
            raise EnvironmentFailure("error", "cancelled: the session was closed") from None
        except Exception:
            raise EnvironmentFailure("error", traceback.format_exc()[-_DETAIL_CHARS:]) from None
        finally:
            if self._calls.get(session) is future:
                del self._calls[session]


def _handler(server: EnvServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive: the client pools its connections
        # Headers and body leave in two writes: with Nagle's algorithm the body then waits for
        # the client's delayed ACK, ~40 ms a reply (measured: 70 ms a call, 0.5 ms without).
        disable_nagle_algorithm = True

        def do_GET(self) -> None:
            if self.path == "/health":
                self._answer(
                    lambda: {
                        "status": "ok",
                        "sessions": server.sessions,
                        "max_sessions": server.max_sessions,
                    }
                )
            elif self.path == "/version":
                self._answer(
                    lambda: {"protocol": PROTOCOL, "asyncrl": __version__, "env": server.path}
                )
            else:
                self._send(HTTPStatus.NOT_FOUND, {"error": "malformed", "detail": self.path})

        def do_POST(self) -> None:
            parts = self.path.strip("/").split("/")
            if parts == ["v1", "sessions"]:
                self._answer(lambda: server.create(self._body()))
            elif len(parts) == 4 and parts[:2] == ["v1", "sessions"] and parts[3] == "step":
                self._answer(lambda: server.step(parts[2], self._body()))
            else:
                self._send(HTTPStatus.NOT_FOUND, {"error": "malformed", "detail": self.path})

        def do_DELETE(self) -> None:
            parts = self.path.strip("/").split("/")
            if len(parts) == 3 and parts[:2] == ["v1", "sessions"]:
                self._answer(lambda: server.close(parts[2]))
            else:
                self._send(HTTPStatus.NOT_FOUND, {"error": "malformed", "detail": self.path})

        def _body(self) -> dict[str, Any]:
            length = int(self.headers.get("Content-Length") or 0)
            if length > _MAX_BODY_BYTES:
                raise _Refused(HTTPStatus.BAD_REQUEST, "malformed", f"body of {length} bytes")
            try:
                body = json.loads(self.rfile.read(length) or b"{}")
            except ValueError as exc:
                raise _Refused(HTTPStatus.BAD_REQUEST, "malformed", f"not JSON: {exc}") from None
            if not isinstance(body, dict):
                raise _Refused(HTTPStatus.BAD_REQUEST, "malformed", "body is not an object")
            return body

        def _answer(self, make: Any) -> None:
            try:
                reply = make()
                payload = json.dumps(reply)  # info the environment filled may not be JSON
            except _Refused as exc:
                self._send(exc.status, {"error": exc.reason, "detail": exc.detail})
            except EnvironmentFailure as exc:
                self._send(
                    HTTPStatus.INTERNAL_SERVER_ERROR, {"error": exc.reason, "detail": exc.detail}
                )
            except (TypeError, ValueError) as exc:
                failure = malformed(f"reply is not JSON: {exc}")
                self._send(
                    HTTPStatus.INTERNAL_SERVER_ERROR,
                    {"error": failure.reason, "detail": failure.detail},
                )
            else:
                self._write(HTTPStatus.OK, payload.encode())

        def _send(self, status: HTTPStatus, body: dict[str, Any]) -> None:
            self._write(status, json.dumps(body).encode())

        def _write(self, status: HTTPStatus, data: bytes) -> None:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format: str, *args: Any) -> None:
            log.debug(format, *args)

    return Handler


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    # A worker opens many sessions at once (a batch of prompts × n): the default backlog of 5
    # would reset connections in such a burst.
    request_queue_size = 1024


def make_server(
    path: str,
    kwargs: dict[str, Any],
    host: str = "127.0.0.1",
    port: int = 0,
    max_sessions: int = 1024,
    python_path: Sequence[str] = (),
) -> ThreadingHTTPServer:
    """The server of `path` (checked first: ValueError with a one-line reason)."""
    env = EnvServer(path, kwargs, max_sessions, python_path)
    return _Server((host, port), _handler(env))


def main(args: argparse.Namespace) -> int:
    """`asyncrl env-server`: a bad option is one line on stderr and exit 2, before binding."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    try:
        kwargs = json.loads(args.kwargs)
        if not isinstance(kwargs, dict):
            raise ValueError("not a JSON object")
        if args.max_sessions < 1:
            raise ValueError("--max-sessions: must be at least 1")
        httpd = make_server(
            args.env,
            kwargs,
            args.host,
            args.port,
            args.max_sessions,
            [os.path.abspath(d) for d in args.python_path],
        )
    except ValueError as exc:
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
