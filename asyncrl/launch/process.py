"""Starting and stopping the child processes of the launchers and the embedded Redis.

A launcher stops its children on Ctrl-C and on SIGTERM or SIGHUP alike (`stop_signals_interrupt`:
container runtimes, `timeout` and a closed terminal send those), and children it starts with
`die_with_parent` are killed by the kernel when it dies without the chance to stop them itself
(SIGKILL, OOM killer).
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
from collections.abc import Callable

# The signals a launcher treats as Ctrl-C.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)
_PR_SET_PDEATHSIG = 1
# Loaded here, not in the forked child: a dlopen after fork can deadlock on a lock another thread
# of the parent held when it forked.
_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None


class Signalled(KeyboardInterrupt):
    """SIGTERM or SIGHUP, raised in the main thread as Ctrl-C raises KeyboardInterrupt, so the
    launcher's `except KeyboardInterrupt` and `finally` stop its children before it exits."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _raise_signalled(signum: int, _frame: object) -> None:
    raise Signalled(signum)


def stop_signals_interrupt() -> None:
    """From now on SIGTERM and SIGHUP raise `Signalled` in the main thread."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, _raise_signalled)


def ignore_stop_signals() -> None:
    """For the launcher's cleanup, bounded by `wait_or_kill`: a second Ctrl-C or SIGTERM must not
    cut it short and leave children or the embedded Redis behind."""
    for sig in (signal.SIGINT, *STOP_SIGNALS):
        signal.signal(sig, signal.SIG_IGN)


def exit_status(exc: KeyboardInterrupt) -> int:
    """The launcher's exit status for an interruption: 128 + the signal, as a shell reports it."""
    return 128 + (exc.signum if isinstance(exc, Signalled) else signal.SIGINT)


def die_with_parent(sig: int) -> Callable[[], None] | None:
    """A `preexec_fn` that makes the kernel send `sig` to the child when its parent dies (Linux
    PR_SET_PDEATHSIG); None elsewhere. The parent is the *thread* that started the child, so start
    such children from a thread that lives as long as they should (the launcher's main thread)."""
    libc = _LIBC
    if libc is None:
        return None
    parent = os.getpid()

    def preexec() -> None:
        if libc.prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
        if os.getppid() != parent:
            os._exit(0)  # the parent died before the request was in place: nobody will stop us

    return preexec


def wait_or_kill(proc: subprocess.Popen[bytes], timeout_s: float) -> int:
    """Wait up to `timeout_s` for `proc` to exit, SIGKILL it after that; its exit status."""
    try:
        return proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()


def stop(proc: subprocess.Popen[bytes], timeout_s: float) -> int:
    """SIGTERM (roles drain on it, redis-server fsyncs its AOF), SIGKILL after `timeout_s`."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    return wait_or_kill(proc, timeout_s)
