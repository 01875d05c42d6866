"""`asyncrl agent-server`: an agent runner, so that agents run in containers or on machines of
their own (`task.agent.type: remote`), as `asyncrl env-server` is for environments. It runs
one `python` agent (`--agent pkg.module:fn`) or one `command` agent (`-- argv...`), the same
runners a rollout worker uses in its own process, once per request.

Protocol version 1 (JSON bodies only; nothing is ever unpickled):

    POST /v1/episodes  {"item": {id, prompt, answer}, "base_url": url, "api_key": key,
                        "timeout_s": seconds}
         → 200 {"reward": number | [number, ...] | null}
    GET  /health       → 200 {"status": "ok", "episodes": n, "max_episodes": m}
    GET  /version      → 200 {"protocol": 1, "asyncrl": version, "agent": what}

`base_url` and `api_key` are the episode's gateway session on the rollout worker (the agent
calls it with them, as an agent in the worker would); the reply comes when the agent ends. A
reward of null: the agent returned none (the worker then takes one it POSTed to its session,
else the task's). An error is `{"error": reason, "detail": text}`: 500 with `agent_error` or
`agent_timeout` when the agent raised, exited non-zero, printed no reward or outlived
`timeout_s` (then it is stopped: a command's process group killed); 400 for a request that does
not fit, 401 without the token, 503 with `unavailable` when `--max-episodes` run already.

Authentication and limits are `asyncrl env-server`'s (`asyncrl.web.aio`): a shared
secret from `--token-env` (default `ASYNCRL_AGENT_SERVER_TOKEN`) or `--token-file` on every
request but `/health` and `/metrics`; without one the server binds to loopback only.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
from http import HTTPStatus
from typing import Any

from pydantic import ValidationError

from asyncrl import __version__
from asyncrl.agents.base import AgentFailure
from asyncrl.agents.command import CommandAgent
from asyncrl.agents.config import CommandAgentConfig, PythonAgentConfig
from asyncrl.agents.episode import bounded, reward_of
from asyncrl.agents.python import PythonAgent
from asyncrl.web.aio import HTTPServer, Refused, Reply, Request, bind, error_body
from asyncrl.web.auth import token_of
from asyncrl.web.serving import serve_until_interrupted

log = logging.getLogger(__name__)

PROTOCOL = 1
TOKEN_ENV = "ASYNCRL_AGENT_SERVER_TOKEN"


class AgentRunner:
    """One agent's episodes, served as protocol v1 (the HTTP server's app)."""

    def __init__(self, cfg: PythonAgentConfig | CommandAgentConfig, max_episodes: int) -> None:
        self.agent: PythonAgent | CommandAgent
        if isinstance(cfg, PythonAgentConfig):
            self.agent, self.what = PythonAgent(cfg), cfg.path
        else:
            self.agent, self.what = CommandAgent(cfg), " ".join(cfg.argv)
        self.max_episodes = max_episodes
        self.episodes = 0

    async def episode(self, body: dict[str, Any]) -> dict[str, Any]:
        item, base_url, api_key = body.get("item"), body.get("base_url"), body.get("api_key")
        timeout_s = body.get("timeout_s")
        if not (
            isinstance(item, dict)
            and isinstance(base_url, str)
            and isinstance(api_key, str)
            and isinstance(timeout_s, int | float)
            and 0 < timeout_s < math.inf
        ):
            raise Refused(
                HTTPStatus.BAD_REQUEST,
                "malformed",
                "body needs item (object), base_url, api_key (strings), timeout_s (> 0)",
            )
        if self.episodes >= self.max_episodes:
            raise Refused(
                HTTPStatus.SERVICE_UNAVAILABLE, "unavailable", f"{self.max_episodes} running"
            )
        self.episodes += 1
        try:
            value = await bounded(self.agent.run(item, base_url, api_key), float(timeout_s))
            return {"reward": reward_of(value)}
        finally:
            self.episodes -= 1

    async def answer(self, request: Request) -> Reply:
        path = request.path.split("?")[0]
        try:
            reply: dict[str, Any]
            if request.method == "GET" and path == "/health":
                reply = {
                    "status": "ok",
                    "episodes": self.episodes,
                    "max_episodes": self.max_episodes,
                }
            elif request.method == "GET" and path == "/version":
                reply = {"protocol": PROTOCOL, "asyncrl": __version__, "agent": self.what}
            elif request.method == "POST" and path == "/v1/episodes":
                reply = await self.episode(request.json())
            else:
                raise Refused(HTTPStatus.NOT_FOUND, "malformed", f"{request.method} {path}")
        except Refused as exc:
            return Reply(exc.status, error_body(exc.reason, exc.detail))
        except AgentFailure as exc:
            log.warning("episode failed: %.300s", exc)
            return Reply(HTTPStatus.INTERNAL_SERVER_ERROR, error_body(exc.reason, exc.detail))
        except Exception as exc:  # the server's own bug: still a reply, never a dropped call
            log.warning("%s %s failed", request.method, path, exc_info=True)
            return Reply(HTTPStatus.INTERNAL_SERVER_ERROR, error_body("error", f"{exc!r:.500}"))
        return Reply(HTTPStatus.OK, json.dumps(reply).encode())

    async def background(self) -> None:
        return

    async def close_all(self) -> None:
        self.agent.shutdown()


def make_server(
    cfg: PythonAgentConfig | CommandAgentConfig,
    host: str = "127.0.0.1",
    port: int = 0,
    token: str | None = None,
    max_episodes: int = 256,
) -> HTTPServer:
    """The runner of `cfg`'s agent, bound; off loopback only with a token (ValueError)."""
    return bind(AgentRunner(cfg, max_episodes), host, port, token, TOKEN_ENV)


def main(args: argparse.Namespace) -> int:
    """`asyncrl agent-server`: a bad option is one line on stderr and exit 2, before binding."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    argv = [a for a in args.argv if a != "--"]
    try:
        if (args.agent is None) == (not argv):
            raise ValueError("give --agent pkg.module:fn or -- a command and its arguments")
        if args.max_episodes < 1:
            raise ValueError("--max-episodes: must be at least 1")
        cfg: PythonAgentConfig | CommandAgentConfig
        if args.agent is not None:
            kwargs = json.loads(args.kwargs)
            python_path = [os.path.abspath(d) for d in args.python_path]
            cfg = PythonAgentConfig(path=args.agent, kwargs=kwargs, python_path=python_path)
        else:
            cfg = CommandAgentConfig(type="command", argv=argv)
        token = token_of(args.token_file, args.token_env, "--token-file")
        httpd = make_server(cfg, args.host, args.port, token, args.max_episodes)
    except ValidationError as exc:  # the agent does not import or take the call
        print(f"asyncrl agent-server: {exc.errors()[0]['msg']}", file=sys.stderr)
        return 2
    except (ValueError, OSError) as exc:  # OSError: the port is taken
        print(f"asyncrl agent-server: {exc}", file=sys.stderr)
        return 2
    return serve_until_interrupted("agent-server", args.host, httpd)
