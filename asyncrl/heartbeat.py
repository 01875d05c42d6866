"""Worker heartbeats: a worker is alive exactly while its key `workers:{role}:{id}` exists.

A daemon thread rewrites the key with a TTL every third of the TTL, so a process that dies (or
hangs) disappears within one TTL, and `stop()` removes it at once on a clean exit. The value is a
small msgpack map of the worker's status plus `ts` (unix seconds of the beat), read back by
`asyncrl.runstate.role_workers` with safe options only. Consumers pass `is_alive(...)` to
`asyncrl.queue.Consumer` so that entries are taken over from dead workers only. A trainer's
heartbeat renews the run's trainer lease with each beat (`asyncrl.lease`), and stops beating once
another trainer took it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import msgpack

if TYPE_CHECKING:
    import redis

    from asyncrl.lease import Lease
    from asyncrl.runstate import Keys

log = logging.getLogger(__name__)

_LOG_EVERY_S = 5.0


class Heartbeat:
    """Keeps `key` alive while the process runs. `status_fn()` gives the fields to publish.

    Redis outages never stop the thread: it retries with backoff (at most a third of the TTL, so
    it beats again soon after Redis returns) and logs at most every few seconds.
    """

    def __init__(
        self,
        client: redis.Redis,
        key: str,
        ttl_s: float,
        status_fn: Callable[[], dict[str, Any]] | None = None,
        lease: Lease | None = None,
    ) -> None:
        """`lease`: renewed with each beat (the run's trainer lease)."""
        if ttl_s <= 0:
            raise ValueError(f"heartbeat ttl_s must be > 0, got {ttl_s}")
        self._client = client
        self.key = key
        self.ttl_s = ttl_s
        self._status_fn = status_fn
        self._lease = lease
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> Heartbeat:
        """Beat once now, so the worker is visible when this returns (unless Redis is down: the
        thread keeps trying), then keep beating in the background."""
        first_wait = self.ttl_s / 3
        try:
            self.beat()
        except Exception as exc:
            log.warning("heartbeat %s: first beat failed: %s", self.key, exc)
            first_wait = 0.0
        self._thread = threading.Thread(
            target=self._run, args=(first_wait,), name=f"heartbeat {self.key}", daemon=True
        )
        self._thread.start()
        return self

    def beat(self) -> None:
        """Write the key once (the thread does this every `ttl_s / 3`); not once the lease is
        lost: the key is then the other trainer's."""
        if self._lease is not None and not self._lease.hold():
            return
        self._client.set(self.key, self._payload(), px=max(1, int(self.ttl_s * 1000)))

    def stop(self) -> None:
        """A clean leave: stop beating and delete the key (and give the lease back), so peers see
        the worker gone now."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(self.ttl_s)
            self._thread = None
        if self._lease is not None and self._lease.lost:
            return  # the key and the lease are the other trainer's
        try:
            self._client.delete(self.key)
            if self._lease is not None:
                self._lease.release()
        except Exception as exc:  # the key expires by itself within one TTL anyway
            log.warning("heartbeat %s: could not delete the key: %s", self.key, exc)

    def __enter__(self) -> Heartbeat:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _payload(self) -> bytes:
        status: dict[str, Any] = {}
        if self._status_fn is not None:
            try:
                status = dict(self._status_fn())
            except Exception:
                # Liveness matters more than the status: still beat, without it.
                log.exception("heartbeat %s: status_fn failed", self.key)
        status["ts"] = time.time()
        return msgpack.packb(status)

    def _run(self, wait: float) -> None:
        period = self.ttl_s / 3
        delay = 0.05
        failing_since: float | None = None
        next_log = 0.0
        while not self._stop.wait(wait):
            try:
                self.beat()
            except Exception as exc:
                # Any failure, not only connection errors: a dead heartbeat thread would make a
                # live worker look dead and its entries be taken over.
                now = time.monotonic()
                failing_since = failing_since or now
                if now >= next_log:
                    log.warning(
                        "heartbeat %s failing for %.0fs: %s: %s",
                        self.key,
                        now - failing_since,
                        type(exc).__name__,
                        exc,
                    )
                    next_log = now + _LOG_EVERY_S
                wait, delay = delay, min(delay * 2, period)
                continue
            if failing_since is not None:
                log.warning(
                    "heartbeat %s: beating again after %.1fs",
                    self.key,
                    time.monotonic() - failing_since,
                )
                failing_since, delay, next_log = None, 0.05, 0.0
            wait = period


def is_alive(
    client: redis.Redis, keys: Keys, role: str, cache_s: float = 1.0
) -> Callable[[str], bool]:
    """`worker_id -> bool` for `Consumer(is_alive=...)`, from one SCAN per `cache_s` at most."""
    prefix = keys.worker(role, "")
    live: set[str] = set()
    expires = 0.0

    def check(worker_id: str) -> bool:
        nonlocal live, expires
        now = time.monotonic()
        if now >= expires:
            pattern = keys.workers_pattern(role)
            live = {_text(k)[len(prefix) :] for k in client.scan_iter(match=pattern, count=1000)}
            expires = now + cache_s
        return worker_id in live

    return check


def _text(x: bytes | str) -> str:
    return x.decode() if isinstance(x, bytes) else x
