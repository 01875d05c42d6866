"""The rollout worker's side of `asyncrl env-server` (`task.environment.type: remote`).

Pooled keep-alive HTTP/1.1 on asyncio streams, one pool per server of at most
`max_sessions_per_server` connections, so calls beyond that wait their turn. Not httpx: its
pool costs time quadratic in the requests waiting on it (measured: 2000 concurrent episodes
took 254 s of CPU through a 256-connection httpx pool), and a worker keeps thousands of
episodes at their tools. New episodes go
round the servers; a session stays on the server that created it (its state lives there).
Creating a session is the one call retried, on the next server (round the list, so the same
one when there is one), up to `retries` times, when the server is to blame (down, full, past
its timeout): before its first step an episode restarts freely. A step that fails is never
retried, since the environment may have acted on it: the episode fails with a reason
(`ENV_REASONS`) and its group is dead-lettered. No request is ever sent twice on a connection
that failed: a pooled connection is reused only when it is known open and was idle well within
the server's keep-alive, and once a request is written, its failure is the call's.

Every request carries the run's token (`token_file` / `token_env`) and the call's deadline
(`timeout_s`), past which the server cancels the call and ends its session. A reply over
`max_reply_bytes` fails the call `malformed` unread.

Pools are per event loop (connections belong to the loop that opened them): each episode
scheduler runs its own loop.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import time
import weakref
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from asyncrl.environments.base import (
    EnvironmentFailure,
    Observation,
    StepResult,
    check_observation,
    check_step,
    malformed,
)
from asyncrl.environments.server import PROTOCOL, TIMEOUT_HEADER
from asyncrl.reasons import ENV_REASONS
from asyncrl.web.aio import KEEP_ALIVE_S
from asyncrl.web.auth import token_of

if TYPE_CHECKING:
    from asyncrl.environments.config import RemoteEnvironmentConfig
    from asyncrl.items import PromptItem

log = logging.getLogger(__name__)
_CLOSE_TIMEOUT_S = 5.0
# A pooled connection older than this is not reused: the server may be closing it just now.
_REUSE_WITHIN_S = KEEP_ALIVE_S / 2

_Conn = tuple[asyncio.StreamReader, asyncio.StreamWriter]


class _Server:
    """One server's connections on one loop: idle ones reused, at most `n` calls at once."""

    def __init__(self, url: str, n: int) -> None:
        parts = urlsplit(url)
        self.https = parts.scheme == "https"
        self.host = parts.hostname or "127.0.0.1"
        self.port = parts.port or (443 if self.https else 80)
        self.slots = asyncio.Semaphore(n)
        self.idle: list[tuple[_Conn, float]] = []  # with the monotonic time it went idle

    def reusable(self) -> _Conn | None:
        """An idle connection still open and young enough, closing the others."""
        while self.idle:
            (reader, writer), since = self.idle.pop()
            if reader.at_eof() or writer.is_closing() or time.monotonic() - since > _REUSE_WITHIN_S:
                writer.close()
                continue
            return reader, writer
        return None


class RemotePool:
    """The env-servers of one config: round-robin placement, per-loop connection pools."""

    def __init__(self, cfg: RemoteEnvironmentConfig) -> None:
        self.cfg = cfg
        token = token_of(cfg.token_file, cfg.token_env, "task.environment.token_file")
        self._auth = f"Authorization: Bearer {token}\r\n" if token else ""
        self._next = itertools.count()
        self._servers: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[str, _Server]] = (
            weakref.WeakKeyDictionary()
        )

    def environment(self) -> RemoteEnvironment:
        return RemoteEnvironment(self)

    def first_server(self) -> int:
        return next(self._next) % len(self.cfg.urls)

    def _server(self, url: str) -> _Server:
        servers = self._servers.setdefault(asyncio.get_running_loop(), {})
        if url not in servers:
            servers[url] = _Server(url, self.cfg.max_sessions_per_server)
        return servers[url]

    async def call(self, url: str, method: str, path: str, body: Any = None) -> dict[str, Any]:
        """One exchange; its failure as an `EnvironmentFailure` with the reason to count."""
        server = self._server(url)
        data = b"" if body is None else json.dumps(body).encode()
        head = (
            f"{method} {path} HTTP/1.1\r\nHost: {server.host}:{server.port}\r\n{self._auth}"
            f"{TIMEOUT_HEADER}: {self.cfg.timeout_s}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
        )
        async with server.slots:  # waiting here is the concurrency bound, not a failure
            status, content = await self._exchange(server, url, path, head.encode() + data)
        try:
            reply = json.loads(content)
        except ValueError:
            raise malformed(f"{url}{path}: HTTP {status}, not JSON: {content!r:.200}") from None
        if not isinstance(reply, dict):
            raise malformed(f"{url}{path}: reply is {type(reply).__name__}, not an object")
        if status != 200:
            reason = reply.get("error")
            if status not in (404, 500, 503) or reason not in ENV_REASONS:
                raise malformed(f"{url}{path}: HTTP {status}: {reply!r:.200}")
            raise EnvironmentFailure(reason, f"{url}{path}: {reply.get('detail')!s:.2000}")
        return reply

    async def _exchange(
        self, server: _Server, url: str, path: str, request: bytes
    ) -> tuple[int, bytes]:
        conn = server.reusable()
        if conn is None:
            try:
                async with asyncio.timeout(self.cfg.connect_timeout_s):
                    conn = await asyncio.open_connection(
                        server.host, server.port, ssl=server.https or None
                    )
            except (OSError, TimeoutError) as exc:
                raise EnvironmentFailure("unavailable", f"{url}: connect: {exc!r}") from None
        reader, writer = conn
        # From here on the server may have the request: whatever fails, it is not sent again.
        try:
            writer.write(request)
            # A timer, not `wait_for`'s task per call (a third of the client's CPU).
            async with asyncio.timeout(self.cfg.timeout_s):
                status, content, keep = await _read_reply(reader, self.cfg.max_reply_bytes)
        except TimeoutError:
            writer.close()
            raise EnvironmentFailure(
                "timeout", f"{url}{path}: no reply in {self.cfg.timeout_s}s"
            ) from None
        except _TooLarge as exc:
            writer.close()
            raise malformed(f"{url}{path}: {exc}") from None
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError) as exc:
            writer.close()
            # refused, reset, closed before or mid-reply: the server is gone or failed
            raise EnvironmentFailure("unavailable", f"{url}{path}: {exc!r}") from None
        except BaseException:  # cancelled: the connection's state is unknown
            writer.close()
            raise
        if keep:
            server.idle.append((conn, time.monotonic()))
        else:
            writer.close()
        return status, content


class _TooLarge(Exception):
    pass


async def _read_reply(reader: asyncio.StreamReader, max_bytes: int) -> tuple[int, bytes, bool]:
    """(status, body, whether the connection stays open) of one HTTP/1.x reply; `_TooLarge`
    for a body over `max_bytes`, before reading it."""
    head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
    version, status = head[0].split(" ", 2)[:2]
    headers = {}
    for line in head[1:]:
        name, sep, value = line.partition(":")
        if sep:
            headers[name.strip().lower()] = value.strip().lower()
    keep = version == "HTTP/1.1" and headers.get("connection") != "close"
    if "content-length" in headers:
        size = int(headers["content-length"])
        if size > max_bytes:
            raise _TooLarge(f"reply of {size} bytes, over max_reply_bytes {max_bytes}")
        content = await reader.readexactly(size)
    else:  # the body runs to the end of the connection
        content, keep = await reader.read(max_bytes + 1), False
        if len(content) > max_bytes:
            raise _TooLarge(f"reply over max_reply_bytes {max_bytes}")
    return int(status), content, keep


class RemoteEnvironment:
    """One episode's session on an env-server: an `Environment`."""

    def __init__(self, pool: RemotePool) -> None:
        self._pool = pool
        self._url: str | None = None
        self._session: str | None = None

    async def reset(self, item: PromptItem) -> Observation:
        urls = self._pool.cfg.urls
        first = self._pool.first_server()
        tries = self._pool.cfg.retries + 1
        body = {
            "item": {
                "prompt_id": item.prompt_id,
                "prompt": item.prompt,
                "prompt_ids": list(item.prompt_ids),
                "answer": item.answer,
            }
        }
        for attempt in range(tries):
            url = urls[(first + attempt) % len(urls)]
            try:
                reply = await self._pool.call(url, "POST", "/v1/sessions", body)
            except EnvironmentFailure as exc:
                # The environment's own failure would repeat elsewhere; the server's need not.
                if exc.reason not in ("unavailable", "timeout") or attempt == tries - 1:
                    raise
                log.warning("env-server %s: %s; trying the next", url, exc)
                continue
            if reply.get("protocol") != PROTOCOL or not isinstance(reply.get("session"), str):
                raise malformed(f"{url}: create answered {reply!r:.200} (protocol {PROTOCOL})")
            self._url, self._session = url, reply["session"]
            return check_observation(reply.get("observation"))
        raise AssertionError("unreachable")  # the last attempt returns or raises

    async def step(self, response: str) -> StepResult:
        if self._url is None or self._session is None:
            raise RuntimeError("step before reset")
        data = await self._pool.call(
            self._url, "POST", f"/v1/sessions/{self._session}/step", {"response": response}
        )
        info = data.get("info", {})
        if data.get("done") is True:
            self._url = None  # the server ended the session with the episode: nothing to close
        return check_step(
            StepResult(
                observation=data.get("observation"),
                done=data.get("done"),  # type: ignore[arg-type]  # checked just below
                reward=data.get("reward"),
                info=info if isinstance(info, dict) else {"info": info},
            )
        )

    async def close(self) -> None:
        if self._url is None or self._session is None:
            return
        url, self._url = self._url, None
        try:
            await asyncio.wait_for(
                self._pool.call(url, "DELETE", f"/v1/sessions/{self._session}"), _CLOSE_TIMEOUT_S
            )
        except (EnvironmentFailure, TimeoutError) as exc:  # the episode is over either way
            log.debug("closing session %s on %s: %s", self._session, url, exc)
