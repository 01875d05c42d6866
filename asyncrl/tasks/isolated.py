"""A `reward.type: python` function, run in a process of its own.

The function is loaded by import path (`asyncrl.plugins.load_object`) in a child process of
its own (`IsolatedReward`) and called there, one call at a time: a call that raises, outlives
`timeout_s` or returns anything but a finite number raises `RewardFailure` with a stable
reason, and the scheduler fails the episode's group with that reason (dead letter, counted) —
the worker goes on. A thread that never returns cannot be stopped, a process can: a timed-out
call's process is killed with its whole process group (helpers it forked included), and the
next call starts a fresh one, so a reward that hangs costs `timeout_s` plus a restart per
call, never a leaked thread or process.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import math
import numbers
import os
import signal
import subprocess
import sys
import threading
import traceback
from collections.abc import Sequence
from multiprocessing.connection import Connection
from typing import Any

import msgpack

from asyncrl.episodes.base import EpisodeFailed
from asyncrl.plugins import load_object
from asyncrl.reasons import GroupReason

# The child imports the user's module before it answers: generous, since that import may pull
# in heavy libraries, and the config already proved the module imports.
_START_TIMEOUT_S = 120.0
_DETAIL_CHARS = 2000
_EXIT_WAIT_S = 5.0  # a child that died by itself is reaped a moment after its pipe closes


class RewardFailure(EpisodeFailed):
    """A reward call that produced no usable number; `reason` is `GroupReason.REWARD_ERROR`,
    `REWARD_TIMEOUT` or `REWARD_INVALID` (the group's dead-letter reason), wherever it was
    called (the scheduler's score, an environment's step)."""


def unsendable(kwargs: dict[str, Any]) -> str | None:
    """Why `kwargs` cannot reach a reward's process (msgpack, read as the child reads it),
    naming the first key that cannot; None when all can. YAML makes values msgpack has no
    place for: dates, sets, integers past 64 bits, maps with non-string keys."""
    for key, value in kwargs.items():
        try:
            msgpack.unpackb(msgpack.packb(value))
        except Exception as exc:  # msgpack's errors share no base class
            kind = type(value).__name__
            return f"{key!r} ({kind}) cannot be sent to the reward's process: {exc}"
    return None


class IsolatedReward:
    """`fn(response, answer, **kwargs)` of a user module, run in a child process; a
    `RewardFn`. Thread-safe: calls are serialised (the scheduler scores one at a time).

    The child is a fresh interpreter (`python -m asyncrl.tasks.isolated`), not a
    multiprocessing spawn, which would re-run the parent's main script in it; it talks msgpack
    over two pipes and ends when the parent closes them or dies.
    """

    def __init__(
        self, path: str, python_path: Sequence[str], kwargs: dict[str, Any], timeout_s: float
    ) -> None:
        self._setup = msgpack.packb([path, list(python_path), dict(kwargs)])
        self._path = path
        self._timeout_s = timeout_s
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[bytes] | None = None
        self._send: Connection | None = None
        self._recv: Connection | None = None
        self._start()

    @property
    def pid(self) -> int | None:
        """The child's process id; None between a failed call and the next."""
        return None if self._proc is None else self._proc.pid

    def __call__(self, response: str, answer: Any) -> float:
        with self._lock:
            if self._proc is None:
                self._start()
            assert self._send is not None and self._recv is not None
            try:
                self._send.send_bytes(msgpack.packb([response, answer]))
                if not self._recv.poll(self._timeout_s):
                    self._stop()
                    raise RewardFailure(
                        GroupReason.REWARD_TIMEOUT, f"no result in {self._timeout_s}s"
                    )
                status, value = msgpack.unpackb(self._recv.recv_bytes())
            except (EOFError, OSError):
                raise RewardFailure(
                    GroupReason.REWARD_ERROR, f"reward process exited ({self._stop(_EXIT_WAIT_S)})"
                ) from None
        if status != "ok":
            raise RewardFailure(status, value)
        return float(value)

    def _start(self) -> None:
        to_child, from_parent = os.pipe()
        from_child, to_parent = os.pipe()
        package_root = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))
        pythonpath = os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")]))
        # A process group of its own: what the reward forks is killed with it, and Ctrl-C in a
        # terminal (sent to the terminal's group) stays with the worker, which drains on it and
        # still scores, then ends the child by closing its pipes.
        self._proc = subprocess.Popen(
            [sys.executable, "-m", __name__, str(to_child), str(to_parent)],
            pass_fds=(to_child, to_parent),
            stdin=subprocess.DEVNULL,
            env={**os.environ, "PYTHONPATH": pythonpath},
            process_group=0,
        )
        os.close(to_child)
        os.close(to_parent)
        self._send = Connection(from_parent, readable=False)
        self._recv = Connection(from_child, writable=False)
        try:
            self._send.send_bytes(self._setup)
            ready = self._recv.poll(_START_TIMEOUT_S)
            status, detail = msgpack.unpackb(self._recv.recv_bytes()) if ready else ("", "")
        except (EOFError, OSError):
            status, detail = "error", f"reward process exited ({self._stop(_EXIT_WAIT_S)})"
        if status != "ready":
            self._stop()
            raise RuntimeError(f"reward {self._path}: {detail or 'no answer'}")

    def _stop(self, wait_s: float = 0.0) -> int | None:
        """Kill the child's process group (the child too unless it exits within `wait_s`), and
        close the pipes; the child's exit code."""
        code = None
        if self._proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                code = self._proc.wait(wait_s)
            # Before the child is reaped where it still runs: its id names the group until then.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self._proc.pid, signal.SIGKILL)
            if code is None:
                code = self._proc.wait()
        for conn in (self._send, self._recv):
            if conn is not None:
                conn.close()
        self._proc = self._send = self._recv = None
        return code


def _serve(recv: Connection, send: Connection) -> None:
    """The child: read [path, python_path, kwargs], import the function, then answer
    [response, answer] messages with ["ok", float] or [reason, detail] until the parent
    closes the pipe."""
    path, python_path, kwargs = msgpack.unpackb(recv.recv_bytes())
    try:
        fn = load_object(path, python_path)
    except ValueError as exc:
        send.send_bytes(msgpack.packb(["error", str(exc)]))
        return
    send.send_bytes(msgpack.packb(["ready", ""]))
    loop = asyncio.new_event_loop()
    while True:
        try:
            response, answer = msgpack.unpackb(recv.recv_bytes())
        except EOFError:  # the parent is gone or done
            return
        try:
            value = fn(response, answer, **kwargs)
            if inspect.isawaitable(value):
                value = loop.run_until_complete(value)
        except Exception:
            reply = [GroupReason.REWARD_ERROR, traceback.format_exc()[-_DETAIL_CHARS:]]
        else:
            reply = _checked(value)
        send.send_bytes(msgpack.packb(reply))


def _checked(value: Any) -> list[Any]:
    """["ok", value] for a finite real number (bools and numpy scalars included)."""
    if not isinstance(value, numbers.Real):
        return [
            GroupReason.REWARD_INVALID,
            f"returned {type(value).__name__} {value!r:.200}, not a number",
        ]
    if not math.isfinite(value):
        return [GroupReason.REWARD_INVALID, f"returned {value!r}, not finite"]
    return ["ok", float(value)]


if __name__ == "__main__":
    _serve(
        Connection(int(sys.argv[1]), writable=False), Connection(int(sys.argv[2]), readable=False)
    )
