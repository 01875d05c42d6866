"""The rollout worker's side of `asyncrl agent-server` (`task.agent.type: remote`): an episode
is one `POST /v1/episodes` to one runner, which runs its agent against the episode's gateway
session and answers its reward (protocol: `asyncrl.agents.runner`).

New episodes go round `urls`. A runner that cannot be reached, or answers 503 (full, stopping),
has not begun the episode: the next is tried, and the round again after a pause, until one
takes it or `start_within_s` is past. Once the request is sent, the episode
is the runner's: a runner that dies or drops the connection fails its group
(`agent_unavailable`), never retried, since its agent may have made calls already. No
connection is pooled: a reused one that the runner closed meanwhile would read as a death
mid-episode, and a connection costs nothing beside an episode.
"""

from __future__ import annotations

import asyncio
import itertools
from http import HTTPStatus
from typing import TYPE_CHECKING, Any

from asyncrl.agents.base import AgentFailure
from asyncrl.reasons import GroupReason
from asyncrl.web.auth import token_of

if TYPE_CHECKING:
    import httpx

    from asyncrl.agents.config import RemoteAgentConfig

_AGENT_REASONS = {r.value: r for r in GroupReason if r.value.startswith("agent_")}
_DETAIL_CHARS = 600
_FIRST_WAIT_S = 0.5
_MAX_WAIT_S = 5.0


class RemoteAgent:
    """Episodes run on agent runners, round `cfg.urls`."""

    def __init__(self, cfg: RemoteAgentConfig) -> None:
        self.cfg = cfg
        token = token_of(cfg.token_file, cfg.token_env, "task.agent.token_file")
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._turn = itertools.count()
        self._client: httpx.AsyncClient | None = None

    async def run(self, given: dict[str, Any], base_url: str, api_key: str) -> Any:
        """What the runner's agent returned for `given`; `AgentFailure` by reason."""
        import httpx  # late: a worker without remote agents never needs it

        if self._client is None:  # made on the loop the episodes run on
            self._client = httpx.AsyncClient(
                timeout=httpx.Timeout(None, connect=self.cfg.connect_timeout_s),
                limits=httpx.Limits(max_keepalive_connections=0),
            )
        loop = asyncio.get_running_loop()
        start = loop.time()
        wait = _FIRST_WAIT_S
        while True:
            # The runner stops its agent when the worker gives the episode up (`timeout_s`
            # counts the wait for a runner too).
            left = max(self.cfg.timeout_s - (loop.time() - start), 1e-3)
            body = {"item": given, "base_url": base_url, "api_key": api_key, "timeout_s": left}
            refused: list[str] = []
            taken = await self._take(body, refused)
            if taken is not None:
                return _reward(*taken)
            if loop.time() + wait > start + self.cfg.start_within_s:
                raise AgentFailure(
                    GroupReason.AGENT_UNAVAILABLE, "no agent runner took it: " + "; ".join(refused)
                )
            await asyncio.sleep(wait)
            wait = min(2 * wait, _MAX_WAIT_S)

    async def _take(
        self, body: dict[str, Any], refused: list[str]
    ) -> tuple[str, httpx.Response] | None:
        """Once round the runners from the next one's turn: the first that takes the episode,
        and its reply once the episode ended; None when none did (each noted in `refused`)."""
        import httpx

        assert self._client is not None
        urls = self.cfg.urls
        first = next(self._turn)
        for i in range(len(urls)):
            url = urls[(first + i) % len(urls)]
            try:
                reply = await self._client.post(
                    f"{url}/v1/episodes", json=body, headers=self._headers
                )
            except httpx.ConnectError as exc:
                refused.append(f"{url}: {exc!r:.200}")
                continue
            except httpx.TransportError as exc:
                raise AgentFailure(
                    GroupReason.AGENT_UNAVAILABLE, f"{url} went away mid-episode: {exc!r:.300}"
                ) from None
            if reply.status_code == HTTPStatus.SERVICE_UNAVAILABLE:
                refused.append(f"{url}: 503 {reply.text[:200]}")
                continue
            return url, reply
        return None

    def shutdown(self) -> None:
        self._client = None  # its loop is gone with the worker; no connection is pooled


def _reward(url: str, reply: httpx.Response) -> Any:
    """The agent's value in a runner's reply, or its failure by reason."""
    try:
        data = reply.json()
    except ValueError:
        data = None
    if not isinstance(data, dict):
        raise AgentFailure(
            GroupReason.AGENT_UNAVAILABLE, f"{url}: {reply.status_code} {reply.text[:200]!r}"
        )
    if reply.status_code == HTTPStatus.OK and "reward" in data:
        return data["reward"]
    reason = _AGENT_REASONS.get(str(data.get("error")), GroupReason.AGENT_UNAVAILABLE)
    detail = f"{data.get('error')}: {data.get('detail')}"[:_DETAIL_CHARS]
    raise AgentFailure(reason, f"{url}: {reply.status_code} {detail}")
