"""The foreground of asyncrl's HTTP commands (`asyncrl serve`, `asyncrl env-server`, `asyncrl
agent-server`): the line that says where they listen, then serving until Ctrl-C; and how a
parent starts one of them as a child and learns its URL from that line."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence
from typing import IO, Protocol


class Serving(Protocol):
    """What every such server is: a socket bound at construction, served until interrupted."""

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


def spawn_cli(
    args: Sequence[str], environ: Mapping[str, str] | None = None, quiet: bool = False
) -> tuple[subprocess.Popen[str], str]:
    """`asyncrl ARGS` (a server that prints where it listens) in a child process of this
    Python, once it listens: (the process, its URL). `environ`: the child's environment
    (default: this one's); `quiet` drops its log. RuntimeError with its first line when it does
    not start."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "asyncrl", *args],
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
        raise RuntimeError(f"asyncrl {' '.join(args)} did not start: {line!r}")
    # What the servers' user code prints must go somewhere: a full pipe would stop the server.
    sink = None if quiet else sys.stdout
    threading.Thread(target=_drain, args=(proc.stdout, sink), daemon=True).start()
    return proc, line.split()[-1]


def _drain(source: IO[str], sink: IO[str] | None) -> None:
    for line in source:
        if sink is not None:
            sink.write(line)
