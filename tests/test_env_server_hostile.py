"""`asyncrl env-server` against environments and clients that misbehave (issue 28, items 7–10):
each through a real server process, real sockets and the worker's client. A hung call is
cancelled at its client's deadline or by the idle sweep; one session's `sys.exit()` fails only
that session; the server always answers and the client never sends a step twice; the server
needs the run's token, bounds what a request costs, hangs up on a dribbled head, caps its
connections and stays quiet out of descriptors."""

from __future__ import annotations

import asyncio
import json
import os
import resource
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from asyncrl.environments.base import EnvironmentFailure
from asyncrl.environments.client import RemotePool
from asyncrl.environments.config import RemoteEnvironmentConfig
from asyncrl.environments.server import spawn
from asyncrl.items import PromptItem

from role_procs import CHILD_ENV, asyncrl, wait_until

ITEM = PromptItem("1+1", "1+1=", [1, 2, 3], "2")
TOKEN = "r28-secret"

# What a step does is named by its response; every step is logged, one line each, so that the
# test sees from outside how many times the environment ran it.
ENV = """
import asyncio, os, sys
from asyncrl.environments import StepResult

class Hostile:
    async def reset(self, item):
        if item.prompt == "hang":
            await asyncio.sleep(3600)
        return "ready"

    async def step(self, response):
        with open(os.environ["STEP_LOG"], "a") as f:
            f.write(response + "\\n")
        if response == "exit":
            sys.exit(3)
        if response == "interrupt":
            raise KeyboardInterrupt
        if response == "cancel":
            raise asyncio.CancelledError
        if response == "generator-exit":
            raise GeneratorExit
        if response == "hang":
            await asyncio.sleep(3600)
        if response == "deep":
            info = []
            for _ in range(100_000):  # deeper than json.dumps goes
                info = [info]
            return StepResult(None, done=True, reward=1.0, info={"deep": info})
        if response == "print":
            print("x" * 100_000, flush=True)  # more than a pipe holds
        return StepResult("more", done=False)

    async def close(self):
        pass
"""


class Server:
    """A real `asyncrl env-server` of `hostile:Hostile`, its stderr in a file."""

    def __init__(self, tmp: Path, *args: str, token: str | None = TOKEN) -> None:
        (tmp / "hostile.py").write_text(textwrap.dedent(ENV))
        self.steps = tmp / "steps.log"
        self.steps.touch()
        self.stderr = tmp / "stderr.log"
        environ = {**os.environ, **CHILD_ENV, "STEP_LOG": str(self.steps)}
        environ.pop("ASYNCRL_ENV_SERVER_TOKEN", None)
        if token is not None:
            environ["ASYNCRL_ENV_SERVER_TOKEN"] = token
        with open(self.stderr, "w") as err:
            self.proc = subprocess.Popen(
                [
                    *(sys.executable, "-m", "asyncrl", "env-server", "--env", "hostile:Hostile"),
                    *("--python-path", str(tmp), "--port", "0", *args),
                ],
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
                env=environ,
            )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert "listening on" in line, line + self.stderr.read_text()
        self.url = line.split()[-1]
        self.port = int(self.url.rsplit(":", 1)[1])
        self.auth = {"Authorization": f"Bearer {token}"} if token else {}

    def health(self) -> dict[str, Any]:
        return httpx.get(f"{self.url}/health").json()

    def logged_steps(self) -> list[str]:
        return self.steps.read_text().splitlines()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


@pytest.fixture
def make_server(tmp_path: Path) -> Iterator[Any]:
    started: list[Server] = []

    def make(*args: str, token: str | None = TOKEN) -> Server:
        started.append(Server(tmp_path, *args, token=token))
        return started[-1]

    yield make
    for s in started:
        s.stop()


@pytest.fixture
def token_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ASYNCRL_ENV_SERVER_TOKEN", TOKEN)


def _pool(url: str, **kw: Any) -> RemotePool:
    return RemotePool(RemoteEnvironmentConfig(urls=[url], **kw))


def _raw(port: int, data: bytes) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port))
    sock.settimeout(30)
    sock.sendall(data)
    return sock


def _recv_all(sock: socket.socket) -> bytes:
    """Everything until the server closes the connection (socket timeout: it never did)."""
    chunks = []
    while chunk := sock.recv(65536):
        chunks.append(chunk)
    return b"".join(chunks)


# --- item 7: hung calls are cancelled and their sessions freed -------------------------------


@pytest.mark.usefixtures("token_env")
def test_a_hung_reset_past_the_clients_deadline_frees_its_sessions(make_server: Any) -> None:
    """Before: each of the three attempts left a session hung on the server, which was then
    full for good (503)."""
    s = make_server("--max-sessions", "3")

    async def episodes() -> None:
        pool = _pool(s.url, timeout_s=0.5, retries=2)
        with pytest.raises(EnvironmentFailure) as failed:
            await pool.environment().reset(PromptItem("h", "hang", [1], None))
        assert failed.value.reason == "timeout"
        wait_until(lambda: s.health()["sessions"] == 0, 30, "the hung resets' sessions freed")
        for _ in range(3):  # the cap is whole again
            assert await pool.environment().reset(ITEM) == "ready"

    asyncio.run(episodes())
    assert s.health()["sessions"] == 3


def test_a_step_hung_in_a_killed_workers_session_is_closed_by_the_idle_sweep(
    make_server: Any,
) -> None:
    """A worker killed mid-step sends no DELETE and no deadline: the step is hung past the idle
    timeout, and the sweep closes its session (before, a session with a call in flight was never
    swept)."""
    s = make_server("--idle-timeout-s", "1")
    created = httpx.post(f"{s.url}/v1/sessions", json={"item": ITEM.__dict__}, headers=s.auth)
    session = created.json()["session"]
    body = json.dumps({"response": "hang"}).encode()
    worker = _raw(
        s.port,
        f"POST /v1/sessions/{session}/step HTTP/1.1\r\nAuthorization: Bearer {TOKEN}\r\n"
        f"Content-Length: {len(body)}\r\n\r\n".encode()
        + body,
    )
    wait_until(lambda: s.logged_steps() == ["hang"], 30, "the step reached the environment")
    worker.close()  # the worker is gone
    wait_until(lambda: s.health()["sessions"] == 0, 30, "the hung session swept")
    assert s.proc.poll() is None


# --- item 8: one session's BaseException fails that session only -----------------------------


@pytest.mark.usefixtures("token_env")
@pytest.mark.parametrize(
    ("response", "raised"),
    [
        ("exit", "SystemExit: 3"),
        ("interrupt", "KeyboardInterrupt"),
        ("cancel", "CancelledError"),
        ("generator-exit", "GeneratorExit"),
    ],
)
def test_an_environment_that_exits_fails_its_session_alone(
    make_server: Any, response: str, raised: str
) -> None:
    s = make_server()

    async def episodes() -> None:
        pool = _pool(s.url, timeout_s=30)
        bystander, doomed = pool.environment(), pool.environment()
        await bystander.reset(ITEM)
        await doomed.reset(ITEM)
        with pytest.raises(EnvironmentFailure) as failed:
            await doomed.step(response)
        assert failed.value.reason == "error" and raised in failed.value.detail
        assert (await bystander.step("go on")).observation == "more"
        assert (await pool.environment().reset(ITEM)) == "ready"

    asyncio.run(episodes())
    assert s.proc.poll() is None


# --- item 9: the server always replies; a step is never sent twice ---------------------------


@pytest.mark.usefixtures("token_env")
def test_a_reply_json_cannot_render_is_an_error_reply_and_the_step_runs_once(
    make_server: Any,
) -> None:
    """Before: the server dropped the connection, the client took it for a stale keep-alive one
    and sent the step again — the environment ran it twice."""
    s = make_server()

    async def episode() -> None:
        env = _pool(s.url, timeout_s=30).environment()
        await env.reset(ITEM)
        with pytest.raises(EnvironmentFailure) as failed:
            await env.step("deep")
        assert failed.value.reason == "malformed" and "RecursionError" in failed.value.detail

    asyncio.run(episode())
    assert s.logged_steps() == ["deep"]


@pytest.mark.parametrize("ids", ["[1e400]", "[NaN]", "[1.5]", "[-1]", "[true]"])
def test_prompt_ids_that_are_not_token_ids_are_refused(make_server: Any, ids: str) -> None:
    s = make_server()
    body = '{"item": {"prompt_id": "a", "prompt": "1+1=", "prompt_ids": ' + ids + "}}"
    reply = httpx.post(f"{s.url}/v1/sessions", content=body, headers=s.auth)
    assert reply.status_code == 400 and reply.json()["error"] == "malformed"
    assert s.health()["sessions"] == 0


async def _drop_the_second_request(requests: list[bytes]) -> asyncio.Server:
    """A server that answers a create, keeps the connection, then hangs up on the next request
    without a word (as the old env-server did on a reply it could not render)."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
            requests.append(head + await reader.readexactly(length))
            if len(requests) > 1:
                writer.close()
                return
            body = json.dumps({"protocol": 1, "session": "s", "observation": "o"}).encode()
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))

    return await asyncio.start_server(handle, "127.0.0.1", 0)


def test_the_client_never_sends_a_step_twice() -> None:
    requests: list[bytes] = []

    async def episode() -> None:
        server = await _drop_the_second_request(requests)
        port = server.sockets[0].getsockname()[1]
        async with server:
            env = _pool(f"http://127.0.0.1:{port}", timeout_s=30).environment()
            await env.reset(ITEM)
            with pytest.raises(EnvironmentFailure) as failed:
                await env.step("once")
            assert failed.value.reason == "unavailable"

    asyncio.run(episode())
    assert [r.split(b" ")[1] for r in requests] == [b"/v1/sessions", b"/v1/sessions/s/step"]


def test_the_client_does_not_read_a_reply_over_its_bound() -> None:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 1073741824\r\n\r\n{")
        await asyncio.sleep(3600)

    async def episode() -> None:
        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        async with server:
            env = _pool(f"http://127.0.0.1:{port}", timeout_s=30, max_reply_bytes=1 << 20)
            with pytest.raises(EnvironmentFailure) as failed:
                await env.environment().reset(ITEM)
            assert failed.value.reason == "malformed"
            assert "over max_reply_bytes" in failed.value.detail

    asyncio.run(episode())


def test_spawn_drains_a_printing_environment(tmp_path: Path, token_env: None) -> None:
    """Before: nothing read the server's stdout after its first line; an environment that
    printed filled the pipe and froze the server."""
    (tmp_path / "hostile.py").write_text(textwrap.dedent(ENV))
    environ = {**os.environ, **CHILD_ENV, "STEP_LOG": str(tmp_path / "steps.log")}
    proc, url = spawn(
        "hostile:Hostile", "--python-path", str(tmp_path), environ=environ, quiet=True
    )
    try:

        async def episode() -> None:
            env = _pool(url, timeout_s=30).environment()
            await env.reset(ITEM)
            for _ in range(10):  # 1 MB printed, 16 pipes full
                assert (await env.step("print")).observation == "more"

        asyncio.run(episode())
    finally:
        proc.kill()
        proc.wait()


# --- item 10: a token, bounded requests, read deadlines, a connection cap ---------------------


def test_every_call_needs_the_runs_token(make_server: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    s = make_server()
    item = {"item": ITEM.__dict__}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}):
        refused = httpx.post(f"{s.url}/v1/sessions", json=item, headers=headers)
        assert refused.status_code == 401 and refused.json()["error"] == "unauthorized"
    assert httpx.get(f"{s.url}/version").status_code == 401
    assert s.health()["sessions"] == 0  # probes and scrapes need no token
    assert httpx.get(f"{s.url}/metrics").status_code == 200

    async def episode(**kw: Any) -> Any:
        return await _pool(s.url, timeout_s=30, **kw).environment().reset(ITEM)

    monkeypatch.delenv("ASYNCRL_ENV_SERVER_TOKEN", raising=False)
    with pytest.raises(EnvironmentFailure, match="401"):
        asyncio.run(episode())
    monkeypatch.setenv("RUN_TOKEN", TOKEN)
    assert asyncio.run(episode(token_env="RUN_TOKEN")) == "ready"


def test_a_server_off_loopback_without_a_token_is_refused(tmp_path: Path) -> None:
    (tmp_path / "hostile.py").write_text(textwrap.dedent(ENV))
    argv = ["env-server", "--env", "hostile:Hostile", "--python-path", str(tmp_path)]
    old = os.environ.pop("ASYNCRL_ENV_SERVER_TOKEN", None)
    try:
        bad = asyncrl(*argv, "--host", "0.0.0.0", "--port", "0")
    finally:
        if old is not None:
            os.environ["ASYNCRL_ENV_SERVER_TOKEN"] = old
    assert bad.returncode == 2, bad.stderr
    assert bad.stderr.count("\n") == 1 and "ASYNCRL_ENV_SERVER_TOKEN" in bad.stderr


def _peak_rss(pid: int) -> int:
    """The process's peak resident memory in bytes (Linux: VmHWM)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


def test_what_a_request_costs_is_bounded_by_the_body_limit(make_server: Any) -> None:
    """An oversized body is refused unread (before: a 63 MiB request cost 2.5 GB); bodies at the
    limit of the most memory-hungry JSON (empty lists), sent at once on many connections, are
    parsed a few at a time."""
    limit = 1 << 20
    s = make_server("--max-body-bytes", str(limit))
    assert s.health()["sessions"] == 0
    before = _peak_rss(s.proc.pid)
    head = f"POST /v1/sessions HTTP/1.1\r\nConnection: close\r\nAuthorization: Bearer {TOKEN}\r\n"
    oversized = _raw(s.port, f"{head}Content-Length: {63 << 20}\r\n\r\n".encode())
    assert _recv_all(oversized).startswith(b"HTTP/1.1 413 ")
    wide = b'{"item": {"prompt_id": "a", "prompt": "p", "prompt_ids": [' + b"[]," * (
        (limit - 100) // 3
    )
    wide = wide[:-1] + b"]}}"
    senders = [
        _raw(s.port, f"{head}Content-Length: {len(wide)}\r\n\r\n".encode() + wide) for _ in range(8)
    ]
    for sock in senders:
        assert _recv_all(sock).startswith(b"HTTP/1.1 400 ")
    grown = _peak_rss(s.proc.pid) - before
    assert grown < 64 * limit, f"peak RSS grew {grown >> 20} MiB for bodies of 1 MiB"
    assert s.proc.poll() is None


def test_a_request_dribbled_in_is_cut_off_at_the_read_deadline(make_server: Any) -> None:
    s = make_server("--read-timeout-s", "1")
    slow = _raw(s.port, b"POST /v1/sess")  # and nothing more
    assert _recv_all(slow).startswith(b"HTTP/1.1 408 ")


def test_connections_past_the_cap_are_refused_and_the_server_recovers(make_server: Any) -> None:
    s = make_server("--max-connections", "4")
    held = [_raw(s.port, b"") for _ in range(4)]
    wait_until(lambda: _refused(s.port), 30, "a fifth connection refused")
    for sock in held:
        sock.close()
    wait_until(lambda: _serves(s.url), 60, "served again")


def _serves(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=30).status_code == 200
    except httpx.TransportError:  # turned away, or still in the backlog
        return False


def _refused(port: int) -> bool:
    with _raw(port, b"GET /health HTTP/1.1\r\n\r\n") as sock:
        reply = _recv_all(sock)
    return reply.startswith(b"HTTP/1.1 503 ") and b"--max-connections" in reply


def test_out_of_descriptors_the_server_logs_a_line_not_a_flood(make_server: Any) -> None:
    """Connections past the process's descriptor limit: `accept` fails every second until they
    go. Before, each failure was a traceback in the log."""
    s = make_server()
    limit = len(os.listdir(f"/proc/{s.proc.pid}/fd")) + 8
    resource.prlimit(s.proc.pid, resource.RLIMIT_NOFILE, (limit, limit))
    logged = s.stderr.stat().st_size
    held = [_raw(s.port, b"") for _ in range(40)]
    fds = f"/proc/{s.proc.pid}/fd"
    wait_until(lambda: len(os.listdir(fds)) >= limit, 30, "the server out of descriptors")
    time.sleep(3)  # three failed accepts or more (one a second): one line
    lines = s.stderr.read_text()[logged:].splitlines()
    assert len(lines) == 1 and "accept failed" in lines[0], lines
    for sock in held:
        sock.close()
    wait_until(lambda: _serves(s.url), 60, "served again")
