"""Command agents (`task.agent.type: command`): any executable run once per episode against its
gateway session, its reward read from its last stdout line.

Each run is a process group of its own (`start_new_session`), so that killing it reaches what
it started (a shell's children, a tool's subprocess): killed when its episode ends, fails, is
given up or times out. The direct child also gets `PR_SET_PDEATHSIG` (Linux), so a worker
SIGKILLed mid-episode leaves no agent running on its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import json
import os
import signal
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from asyncrl.agents.config import CommandAgentConfig

_TAIL_CHARS = 600
"""Of an agent's stderr, the end that a failure's detail carries (whole within a dead
letter's detail bound, with the exit before it)."""

_PR_SET_PDEATHSIG = 1


class CommandFailed(Exception):
    """The command exited non-zero or its last stdout line is no reward; `str()` says how."""


def die_with_parent() -> None:  # pragma: no cover - runs in the forked child
    if sys.platform == "linux":
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def kill_group(pid: int) -> None:
    """SIGKILL the process group `pid` leads (nothing if it is gone)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


class CommandAgent:
    def __init__(self, cfg: CommandAgentConfig) -> None:
        self.cfg = cfg

    async def run(self, item: dict[str, Any], base_url: str, api_key: str) -> Any:
        return await run_command(self.cfg, item, base_url, api_key)

    def shutdown(self) -> None:
        return  # each episode's process group ends with its episode


async def run_command(
    cfg: CommandAgentConfig, item: dict[str, Any], base_url: str, api_key: str
) -> Any:
    """Run the agent once for `item`; its last stdout line parsed as JSON (None for no
    output). Its process group is killed when this returns or is cancelled (the episode
    given up: a timeout, its group failed, the worker stopping)."""
    given = json.dumps(item)
    env = {
        **os.environ,
        **cfg.env,
        "OPENAI_BASE_URL": base_url,
        "OPENAI_API_KEY": api_key,
        "ASYNCRL_ITEM": given,
    }
    proc = await asyncio.create_subprocess_exec(
        *cfg.argv,
        cwd=cfg.cwd,
        env=env,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        start_new_session=True,
        preexec_fn=die_with_parent,
    )
    try:
        out, err = await proc.communicate(given.encode())
    finally:
        kill_group(proc.pid)
    tail = err.decode(errors="replace")[-_TAIL_CHARS:].strip()
    code = proc.returncode
    if code != 0:
        how = f"killed by {signal.Signals(-code).name}" if code and code < 0 else f"exited {code}"
        raise CommandFailed(f"{cfg.argv[0]} {how}; stderr: {tail}")
    lines = out.decode(errors="replace").strip().splitlines()
    if not lines:
        return None  # no reward of its own: one it POSTed, else the task's
    last = lines[-1]
    try:
        return json.loads(last)
    except ValueError:
        raise CommandFailed(
            f"last stdout line {last[:200]!r} is no JSON reward; stderr: {tail}"
        ) from None
