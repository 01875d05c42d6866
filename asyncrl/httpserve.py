"""The foreground of asyncrl's HTTP commands (`asyncrl serve`, `asyncrl env-server`, `asyncrl
agent-server`): the line that says where they listen, then serving until Ctrl-C."""

from __future__ import annotations

import contextlib
from typing import Protocol


class Serving(Protocol):
    """What both servers are: a socket bound at construction, served until interrupted."""

    server_port: int

    def serve_forever(self) -> None: ...

    def server_close(self) -> None: ...


def serve_until_interrupted(command: str, host: str, server: Serving) -> int:
    """Serve until KeyboardInterrupt; the command's exit status (0)."""
    # One line on stdout, flushed: how a parent that asked for port 0 learns the port.
    print(f"asyncrl {command}: listening on http://{host}:{server.server_port}", flush=True)
    try:
        with contextlib.suppress(KeyboardInterrupt):
            server.serve_forever()
    finally:
        server.server_close()
    return 0
