"""verifiers environments' episodes (`task.type: verifiers`), run by the verifiers runner
(`asyncrl/agents/vf_runner.py`) in the verifiers venv.

Why a process of its own with JSON lines over pipes, not `asyncrl agent-server`: the runner
lives in another venv (verifiers 0.4 needs `openai<3`), so it cannot import asyncrl, and an
HTTP server in it would need a port, a token and a health protocol for what is a child of one
worker. Pipes give all of that for free: the worker owns it, it dies with the worker
(`PR_SET_PDEATHSIG`), and its replies are matched to episodes by id. One runner per worker
keeps verifiers' start-up (seconds: its imports, the environment, the interception server) off
every episode; verifiers runs many episodes in it at once on its own event loop.

Failures follow the gateway's rules: an episode verifiers reports failed, or that raised in
the runner, fails its group (`agent_error`, verifiers' message as detail); the runner dying
fails only the episodes it was running (`agent_error`, with its exit), and the next episode
starts a fresh one.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from asyncrl.agents.base import AgentFailure
from asyncrl.agents.command import die_with_parent, kill_group
from asyncrl.reasons import GroupReason

if TYPE_CHECKING:
    from asyncrl.agents.config import VerifiersConfig

RUNNER = Path(__file__).with_name("vf_runner.py")
_LINE_LIMIT = 1 << 26
"""Bytes of one reply line (a split's task list can be large)."""
_REAP_S = 5.0
"""Seconds `shutdown` waits for the killed runner to be reaped."""


def runner_argv(cfg: VerifiersConfig) -> list[str]:
    spec = {
        "env": cfg.env,
        "python_path": [str(Path(p).resolve()) for p in cfg.python_path],
        "env_args": cfg.env_args,
        "runtime": cfg.runtime,
        "splits": {"train": cfg.train_select, "eval": cfg.eval_select or {}},
        "traces_dir": None if cfg.traces_dir is None else str(Path(cfg.traces_dir).resolve()),
    }
    # Run by path, not as `python vf_runner.py`, which would put this package's directory first
    # on its sys.path, where `verifiers.py`, `config.py`, ... would shadow what it imports.
    run = "import runpy, sys; runpy.run_path(sys.argv[1], run_name='__main__')"
    return [cfg.python, "-c", run, str(RUNNER), json.dumps(spec)]


def runner_env(cfg: VerifiersConfig) -> dict[str, str]:
    """The worker's environment with the venv's `bin` first on PATH: verifiers runs harness
    scripts with `uv`, which it reuses from PATH (installing none) when the venv has it."""
    bin_dir = str(Path(cfg.python).absolute().parent)  # not resolve(): a venv links its python
    return {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"}


def list_tasks(cfg: VerifiersConfig, timeout_s: float = 600) -> dict[str, list[Any]]:
    """Each split's tasks (`idx`, `prompt`, `data`; "eval" only with `eval_select`), read by
    one runner started for them; ValueError, one line naming the key, when verifiers cannot
    load the environment."""
    splits = ["train"] if cfg.eval_select is None else ["train", "eval"]
    requests = "".join(
        json.dumps({"op": "tasks", "id": i, "split": s}) + "\n" for i, s in enumerate(splits)
    )
    try:
        done = subprocess.run(
            runner_argv(cfg),
            input=requests,
            capture_output=True,
            text=True,
            env=runner_env(cfg),
            timeout=timeout_s,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ValueError(f"task.python: cannot run {cfg.python}: {exc}") from None
    replies = {}
    for line in done.stdout.splitlines():
        reply = json.loads(line)
        replies[splits[reply.pop("id")]] = reply
    for split in splits:
        reply = replies.get(split, {"error": done.stderr.strip()[-400:]})
        if "error" in reply:
            raise ValueError(f"task.env: verifiers cannot load {cfg.env!r}: {reply['error']}")
    return {split: list(replies[split]["tasks"]) for split in splits}


class VerifiersAgent:
    """A worker's runner process and the episodes it runs (an agent of `asyncrl.agents.base`)."""

    def __init__(self, cfg: VerifiersConfig) -> None:
        self.cfg = cfg
        self._proc: asyncio.subprocess.Process | None = None
        self._waiting: dict[int, tuple[asyncio.subprocess.Process, asyncio.Future[Any]]] = {}
        """Each episode's runner and reply, by its id."""
        self._next = 0
        self._lock: asyncio.Lock | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._reader: asyncio.Task[None] | None = None

    async def run(self, given: dict[str, Any], base_url: str, api_key: str) -> Any:
        """The episode's rubric reward; `AgentFailure` when verifiers failed it or the runner
        died under it."""
        proc = await self._runner()
        self._next += 1
        key = self._next
        reply: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._waiting[key] = (proc, reply)
        # The session's key is in its base URL's path: the eval client sends no key of ours.
        msg = {"op": "episode", "id": key, "data": given["answer"], "base_url": base_url}
        try:
            await self._send(proc, msg)
            answer = await reply
        except asyncio.CancelledError:
            # Given up (its group failed, a timeout): verifiers stops the episode's harness.
            with contextlib.suppress(OSError, RuntimeError):
                await self._send(proc, {"op": "cancel", "id": key})
            raise
        finally:
            self._waiting.pop(key, None)
        if "error" in answer:
            raise AgentFailure(GroupReason.AGENT_ERROR, str(answer["error"]))
        return answer["reward"]

    async def _send(self, proc: asyncio.subprocess.Process, msg: dict[str, Any]) -> None:
        assert proc.stdin is not None
        proc.stdin.write((json.dumps(msg) + "\n").encode())
        await proc.stdin.drain()

    async def _runner(self) -> asyncio.subprocess.Process:
        """The live runner, started on first use and again after it died."""
        if self._lock is None:
            self._lock = asyncio.Lock()
            self._loop = asyncio.get_running_loop()
        async with self._lock:
            if self._proc is None or self._proc.returncode is not None:
                self._proc = await asyncio.create_subprocess_exec(
                    *runner_argv(self.cfg),
                    env=runner_env(self.cfg),
                    stdin=asyncio.subprocess.PIPE,
                    stdout=asyncio.subprocess.PIPE,
                    stderr=sys.stderr,
                    start_new_session=True,
                    preexec_fn=die_with_parent,
                    limit=_LINE_LIMIT,
                )
                self._reader = asyncio.get_running_loop().create_task(self._read(self._proc))
            return self._proc

    async def _read(self, proc: asyncio.subprocess.Process) -> None:
        """Replies to their episodes until the runner's stdout ends; then every episode it
        was running fails."""
        assert proc.stdout is not None
        while line := await proc.stdout.readline():
            reply = json.loads(line)
            _, waiting = self._waiting.get(reply.pop("id"), (None, None))
            if waiting is not None and not waiting.done():
                waiting.set_result(reply)
        code = await proc.wait()
        for ran, waiting in self._waiting.values():
            if ran is proc and not waiting.done():
                waiting.set_result({"error": f"the verifiers runner died (exit {code})"})

    def shutdown(self) -> None:
        """Kill the runner (its process group: harness programs too) and reap it on its loop,
        from the thread that closes the scheduler."""
        proc, loop = self._proc, self._loop
        if proc is None or loop is None:
            return
        kill_group(proc.pid)
        if loop.is_running():
            reaped = asyncio.run_coroutine_threadsafe(self._reaped(), loop)
            with contextlib.suppress(TimeoutError):
                reaped.result(timeout=_REAP_S)

    async def _reaped(self) -> None:
        if self._reader is not None:
            await self._reader
