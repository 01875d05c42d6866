"""Stopping child processes the launchers and the embedded Redis started."""

from __future__ import annotations

import signal
import subprocess


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
