"""The rollout worker's side of `asyncrl env-server` (`task.environment.type: remote`).

Pooled keep-alive HTTP (httpx), one connection pool per server of at most
`max_sessions_per_server` connections, so calls beyond that wait their turn. New episodes go
round the servers; a session stays on the server that created it (its state lives there).
Creating a session is the one call retried, on the next server (round the list, so the same
one when there is one), up to `retries` times, when the server is to blame (down, full, past
its timeout): before its first step an episode restarts freely. A step that fails is never
retried, since the environment may have acted on it: the episode fails with a reason
(`ENV_REASONS`) and its group is dead-lettered.

Pools are per event loop (httpx clients belong to the loop that made them): each episode
scheduler runs its own loop.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import weakref
from typing import TYPE_CHECKING, Any

from asyncrl.environments.base import (
    ENV_REASONS,
    EnvironmentFailure,
    Observation,
    StepResult,
    check_observation,
    check_step,
    malformed,
)
from asyncrl.environments.server import PROTOCOL

if TYPE_CHECKING:
    import httpx

    from asyncrl.environments.config import RemoteEnvironmentConfig
    from asyncrl.tasks.base import PromptItem

log = logging.getLogger(__name__)
_CLOSE_TIMEOUT_S = 5.0


class RemotePool:
    """The env-servers of one config: round-robin placement, per-loop connection pools."""

    def __init__(self, cfg: RemoteEnvironmentConfig) -> None:
        self.cfg = cfg
        self._next = itertools.count()
        self._clients: weakref.WeakKeyDictionary[
            asyncio.AbstractEventLoop, dict[str, httpx.AsyncClient]
        ] = weakref.WeakKeyDictionary()

    def environment(self) -> RemoteEnvironment:
        return RemoteEnvironment(self)

    def first_server(self) -> int:
        return next(self._next) % len(self.cfg.urls)

    def client(self, url: str) -> httpx.AsyncClient:
        import httpx

        clients = self._clients.setdefault(asyncio.get_running_loop(), {})
        if url not in clients:
            n = self.cfg.max_sessions_per_server
            clients[url] = httpx.AsyncClient(
                base_url=url,
                limits=httpx.Limits(max_connections=n, max_keepalive_connections=n),
                # Waiting for a free connection is the concurrency bound, not a failure.
                timeout=httpx.Timeout(
                    self.cfg.timeout_s, connect=self.cfg.connect_timeout_s, pool=None
                ),
            )
        return clients[url]

    async def call(self, url: str, method: str, path: str, body: Any = None) -> dict[str, Any]:
        """One exchange; its failure as an `EnvironmentFailure` with the reason to count."""
        import httpx

        try:
            reply = await self.client(url).request(method, path, json=body)
        except httpx.ConnectTimeout as exc:
            raise EnvironmentFailure("unavailable", f"{url}: connect: {exc!r}") from None
        except httpx.TimeoutException:
            raise EnvironmentFailure(
                "timeout", f"{url}{path}: no reply in {self.cfg.timeout_s}s"
            ) from None
        except httpx.HTTPError as exc:  # refused, reset, closed mid-reply: the server is gone
            raise EnvironmentFailure("unavailable", f"{url}{path}: {exc!r}") from None
        try:
            data = json.loads(reply.content)
        except ValueError:
            raise malformed(
                f"{url}{path}: HTTP {reply.status_code}, not JSON: {reply.content!r:.200}"
            ) from None
        if not isinstance(data, dict):
            raise malformed(f"{url}{path}: reply is {type(data).__name__}, not an object")
        if reply.status_code != 200:
            reason = data.get("error")
            if reply.status_code not in (404, 500, 503) or reason not in ENV_REASONS:
                raise malformed(f"{url}{path}: HTTP {reply.status_code}: {data!r:.200}")
            raise EnvironmentFailure(reason, f"{url}{path}: {data.get('detail')!s:.2000}")
        return data


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
