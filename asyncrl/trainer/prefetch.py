"""Reading ahead: the trainer's next groups are read and decoded while it trains.

A thread is the consumer's only user. It keeps `read_ahead` deliveries buffered beyond what a
waiting `take` asks for. Reads block for short spells, so
that acks handed to the thread (stale drops, the checkpoint's acks) wait at most one spell, and
`before_read` runs at every spell whether the thread reads or not (rank 0 releases prompts there,
so that they go out while the step trains rather than after it). Buffered deliveries are pending
on the consumer like any read but not yet trained: a trainer that stops leaves them pending, and
they are read again after a restart.

Read-ahead is for a single trainer rank: ranks read from one consumer group, and a rank that read
its next share early could hold entries another rank needs to finish the current step (in sync
mode, the only entries there are).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Generic, TypeVar

from asyncrl.queue import Consumer, Delivery
from asyncrl.redis_conn import Stopped

T = TypeVar("T")

READ_BLOCK_MS = 50
"""Longest blocking read: the most an ack waits for the thread to come back from Redis."""


class Prefetcher(Generic[T]):
    def __init__(
        self,
        consumer: Consumer[T],
        *,
        read_ahead: int = 0,
        before_read: Callable[[], None] = lambda: None,
        settle: Callable[[list[str], str], int] | None = None,
        block_ms: int = READ_BLOCK_MS,
    ) -> None:
        self._consumer = consumer
        self._read_ahead = read_ahead
        self._wanted = 0  # what a waiting `take` asks for
        self._before_read = before_read
        self._settle = settle or consumer.settle
        self._block_ms = block_ms
        self._buffer: deque[Delivery[T]] = deque()
        self._acks: deque[tuple[list[str], str, Future[int]]] = deque()
        self._changed = threading.Condition()
        self._error: BaseException | None = None
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="prefetch", daemon=True)

    def start(self) -> Prefetcher[T]:
        """Start the thread (the first `take` or `ack` does if nothing did): before, the consumer
        is the caller's to use."""
        with self._changed:
            if self._thread.ident is None and not self._closed:
                self._thread.start()
        return self

    def set_read_ahead(self, count: int) -> None:
        """Deliveries to keep buffered beyond what a waiting `take` asks for (0: read only on
        demand); what is buffered already stays."""
        with self._changed:
            self._read_ahead = count
            self._changed.notify_all()

    def buffered(self) -> int:
        """Deliveries read and decoded but not yet taken (read-ahead depth)."""
        with self._changed:
            return len(self._buffer)

    def take(self, count: int, timeout_s: float) -> list[Delivery[T]]:
        """Up to `count` buffered deliveries, oldest first; waits up to `timeout_s` for one."""
        deadline = time.monotonic() + timeout_s
        self.start()
        with self._changed:
            self._wanted = count
            self._changed.notify_all()
            try:
                while not self._buffer and self._error is None:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        return []
                    self._changed.wait(left)
                self._raise()
                taken = [self._buffer.popleft() for _ in range(min(count, len(self._buffer)))]
            finally:
                self._wanted = 0
            self._changed.notify_all()  # room to read into
        return taken

    def settle(self, ids: list[str], outcome: str = "", *, wait: bool = True) -> int | None:
        """`settle` (default `Consumer.settle`) on the thread; with `wait`, how many it counted
        once applied."""
        done: Future[int] = Future()
        self.start()
        with self._changed:
            self._raise()
            self._acks.append((ids, outcome, done))
            self._changed.notify_all()
        return done.result() if wait else None

    def flush(self) -> None:
        """Wait until the acks handed over so far are applied."""
        self.settle([])

    def close(self) -> None:
        """Stop after the acks handed over so far; buffered deliveries stay pending."""
        with self._changed:
            self._closed = True
            self._changed.notify_all()
        if self._thread.is_alive():
            self._thread.join()

    def _raise(self) -> None:
        if isinstance(self._error, Stopped):
            raise self._error  # the consumer's owner is stopping: not a failure of the thread
        if self._error is not None:
            raise RuntimeError("the prefetch thread failed") from self._error

    def _run(self) -> None:
        acks: list[tuple[list[str], str, Future[int]]] = []
        try:
            while True:
                with self._changed:
                    if not self._acks and not self._closed and self._room() <= 0:
                        self._changed.wait(self._block_ms / 1000)
                    acks = list(self._acks)
                    self._acks.clear()
                    closed = self._closed
                while acks:
                    ids, outcome, done = acks[0]
                    done.set_result(self._settle(ids, outcome) if ids else 0)
                    acks.pop(0)
                if closed:
                    return
                self._before_read()
                room = self._room()
                if room > 0:
                    got = self._consumer.read(room, self._block_ms)
                    with self._changed:
                        self._buffer.extend(got)
                        self._changed.notify_all()
        except BaseException as exc:
            with self._changed:
                self._error = exc
                for _, _, done in [*acks, *self._acks]:
                    done.set_exception(exc)
                self._changed.notify_all()

    def _room(self) -> int:
        return self._wanted + self._read_ahead - len(self._buffer)
