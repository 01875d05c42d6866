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

One asyncio event loop does everything: it accepts connections, reads requests (the HTTP layer,
`asyncrl.web.aio`, with these limits) and runs the environments' coroutines (the
sessions and protocol v1, here), so a waiting session costs a timer, not a thread. An
environment that blocks the loop stalls every session of the server (`Environment` says to
move blocking work to a thread).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import os
import socket
import sys
import traceback
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from http import HTTPStatus
from typing import TYPE_CHECKING, Any

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
from asyncrl.metrics.roles import REGISTRY, RoleMetrics
from asyncrl.reasons import ENV_REASONS
from asyncrl.web import aio
from asyncrl.web.aio import Refused, Reply, Request, error_body
from asyncrl.web.auth import token_of
from asyncrl.web.serving import serve_until_interrupted, spawn_cli

if TYPE_CHECKING:
    import subprocess

log = logging.getLogger(__name__)

PROTOCOL = 1
TOKEN_ENV = "ASYNCRL_ENV_SERVER_TOKEN"
# The client's deadline for one call, in seconds: past it the server cancels the call.
TIMEOUT_HEADER = "x-asyncrl-timeout-s"
_DETAIL_CHARS = 2000
_CLOSE_TIMEOUT_S = 5.0


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
    """The sessions of one environment class, served as protocol v1 (the HTTP server's app);
    its methods run on the server's event loop."""

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
            raise Refused(
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
            raise Refused(HTTPStatus.BAD_REQUEST, "malformed", "body needs a `response` string")
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
            raise Refused(HTTPStatus.NOT_FOUND, "unavailable", f"no session {session!r}")
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

    async def answer(self, request: Request) -> Reply:
        """Protocol v1's reply to `request`: the environment's failures and the server's own
        bugs too are an error reply, never a dropped call."""
        if request.method == "GET" and request.path.split("?")[0] == "/metrics":
            return Reply(HTTPStatus.OK, generate_latest(REGISTRY), CONTENT_TYPE_LATEST)
        parts = request.path.split("?")[0].strip("/").split("/")
        try:
            reply: dict[str, Any]
            if request.method == "GET" and parts == ["health"]:
                reply = {
                    "status": "ok",
                    "sessions": self.sessions,
                    "max_sessions": self.max_sessions,
                }
            elif request.method == "GET" and parts == ["version"]:
                reply = {"protocol": PROTOCOL, "asyncrl": __version__, "env": self.path}
            elif parts[:2] != ["v1", "sessions"]:
                raise Refused(HTTPStatus.NOT_FOUND, "malformed", request.path)
            elif request.method == "POST" and len(parts) == 2:
                reply = await self.create(request.json(), _call_deadline(request))
            elif request.method == "POST" and len(parts) == 4 and parts[3] == "step":
                reply = await self.step(parts[2], request.json(), _call_deadline(request))
            elif request.method == "DELETE" and len(parts) == 3:
                reply = await self.close(parts[2])
            else:
                what = f"{request.method} {request.path}"
                raise Refused(HTTPStatus.NOT_FOUND, "malformed", what)
            data = json.dumps(reply).encode()  # info the environment filled may not be JSON
            answer, outcome = Reply(HTTPStatus.OK, data), "ok"
        except Refused as exc:
            answer, outcome = _failed(exc.status, exc.reason, exc.detail), "refused"
        except EnvironmentFailure as exc:
            answer = _failed(HTTPStatus.INTERNAL_SERVER_ERROR, exc.reason, exc.detail)
            outcome = exc.reason if exc.reason in ENV_REASONS else "error"
        except (TypeError, ValueError, RecursionError) as exc:
            # An info the environment filled that JSON cannot hold (an object, nesting deeper
            # than `json.dumps` goes): that call fails with a reply, the connection stays.
            failure = malformed(f"reply is not JSON: {exc!r:.500}")
            answer = _failed(HTTPStatus.INTERNAL_SERVER_ERROR, failure.reason, failure.detail)
            outcome = failure.reason
        except Exception as exc:  # the server's own bug: still a reply, never a dropped call
            log.warning("%s %s failed", request.method, request.path, exc_info=True)
            answer = _failed(HTTPStatus.INTERNAL_SERVER_ERROR, "error", f"server: {exc!r:.500}")
            outcome = "error"
        if parts[:2] == ["v1", "sessions"]:
            self.metrics.env_server_requests[outcome].inc()
        return answer

    async def background(self) -> None:
        """Closes idle sessions while the server runs (when `idle_timeout_s` is set), looking
        a few times per timeout: a session outlives it by at most a quarter."""
        if self.idle_timeout_s <= 0:
            return
        every = min(self.idle_timeout_s / 4, 60.0)
        while True:
            await asyncio.sleep(every)
            closed = await self.close_idle()
            if closed:
                log.warning(
                    "closed %d session(s) no call used for %gs (their workers are gone?)",
                    closed,
                    self.idle_timeout_s,
                )


def _failed(status: HTTPStatus, reason: str, detail: str) -> Reply:
    return Reply(status, error_body(reason, detail))


def _call_deadline(request: Request) -> float | None:
    """The client's deadline for this call, in seconds; None when it sent none."""
    value = request.headers.get(TIMEOUT_HEADER)
    if value is None:
        return None
    try:
        seconds = float(value)
    except ValueError:
        seconds = math.nan
    if not 0 < seconds < math.inf:
        raise Refused(HTTPStatus.BAD_REQUEST, "malformed", f"{TIMEOUT_HEADER}: {value!r:.50}")
    return seconds


def _prompt_item(raw: object) -> Any:
    """The `item` of a create request, every field of its exact JSON type."""
    from asyncrl.items import PromptItem

    if not isinstance(raw, dict):
        raise Refused(HTTPStatus.BAD_REQUEST, "malformed", "body needs an `item` object")
    prompt_id, prompt, ids = raw.get("prompt_id"), raw.get("prompt"), raw.get("prompt_ids")
    if not (isinstance(prompt_id, str) and isinstance(prompt, str) and isinstance(ids, list)):
        raise Refused(
            HTTPStatus.BAD_REQUEST, "malformed", "item needs prompt_id, prompt and prompt_ids"
        )
    if not all(type(t) is int and 0 <= t < 1 << 32 for t in ids):
        raise Refused(
            HTTPStatus.BAD_REQUEST, "malformed", "prompt_ids are not all integers in [0, 2^32)"
        )
    return PromptItem(prompt_id=prompt_id, prompt=prompt, prompt_ids=ids, answer=raw.get("answer"))


def make_server(
    path: str,
    kwargs: dict[str, Any],
    host: str = "127.0.0.1",
    port: int = 0,
    max_sessions: int = 1024,
    python_path: Sequence[str] = (),
    idle_timeout_s: float = 0.0,
    token: str | None = None,
    max_body_bytes: int = aio.DEFAULT_MAX_BODY_BYTES,
    max_connections: int = aio.DEFAULT_MAX_CONNECTIONS,
    read_timeout_s: float = aio.DEFAULT_READ_TIMEOUT_S,
) -> aio.HTTPServer:
    """The server of `path` (checked first: ValueError with a one-line reason), bound. Without
    `token` it serves loopback only: nothing beyond this host may reach it unauthenticated."""
    env = EnvServer(path, kwargs, max_sessions, python_path, idle_timeout_s)
    return aio.bind(
        env, host, port, token, TOKEN_ENV, max_body_bytes, read_timeout_s, max_connections
    )


def spawn(
    env: str, *args: str, environ: Mapping[str, str] | None = None, quiet: bool = False
) -> tuple[subprocess.Popen[str], str]:
    """`asyncrl env-server --env ENV --port 0 ARGS` in a child process of this Python, once it
    listens: (the process, its URL). `environ`: the child's environment (default: this one's);
    `quiet` drops its log. RuntimeError with its first line when it does not start."""
    return spawn_cli(["env-server", "--env", env, "--port", "0", *args], environ, quiet)


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
        token = token_of(args.token_file, args.token_env, "--token-file")
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
