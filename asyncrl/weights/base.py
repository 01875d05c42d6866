"""The weight-sync seam: a publisher on trainer rank 0, a subscriber in each rollout worker.

Both ends are small Protocols so that the trainer and the rollout engine never see a transport;
the roles pick one from `WeightsConfig.type` (`trainer.backends.build_publisher`,
`rollout.backends.build_subscriber`), the only places that do. The choices common to all
transports live here, in two base classes:

- Publishing never waits on the network. `publish()` copies the parameters into a staging buffer
  (the only time the trainer blocks, returned in seconds; on an accelerator the copies are only
  queued on the trainer's stream) and a background thread sends. There
  are two buffers: the sender owns one (the version being sent, or the last one sent — kept to
  catch up workers that join while the trainer is busy), `publish()` fills the other. A version
  staged while another is in flight waits; a newer one staged before it left replaces it, so
  after a slow send only the newest version goes (coalescing). With `defer_copy` even the copy
  leaves the trainer's thread: the sender makes it while the next step's forward and backward
  run, and the trainer waits for it (`copied()`, from its optimizer's step pre-hook) only
  before it changes the parameters — or makes it itself there, if the sender is still busy
  with an older version, which costs what a plain `publish()` would have.
- Bytes the receivers would throw away are not sent: a subscriber says which floating dtype its
  engine keeps (`keeps_dtype`, e.g. bf16), and while every live subscriber keeps the same one,
  wider floating tensors (fp32 masters) are cast to it as they are staged — half the bytes to
  copy, send and check. A subscriber that says nothing gets the trainer's dtypes, bit for bit.
- Receiving happens on the subscriber's own thread; `on_weights(tensors, version)` is called
  there with tensors the subscriber never touches again (the engine may keep them). It should
  stage and return: the sender waits for every subscriber, so a slow callback slows them all.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Generic, Protocol, TypeVar

import torch

from asyncrl.device import copies_done
from asyncrl.weights.buckets import FlatBuffer, Layout, Packer
from asyncrl.weights.fields import SyncFields

if TYPE_CHECKING:
    import redis

    from asyncrl.runstate import Keys

log = logging.getLogger(__name__)

Params = torch.nn.Module | Iterable[tuple[str, torch.Tensor]]
"""What is published: a module (its `named_parameters()`, full tensors — gather FSDP shards
first) or (name, tensor) pairs such as `state_dict().items()`."""

OnWeights = Callable[[dict[str, torch.Tensor], int], None]
"""Receives (name → tensor, version); the engine's `stage_weights` has this signature."""


class Released(dict[str, torch.Tensor]):
    """Weights handed over for good: the subscriber never writes their storage again, so an
    engine may keep these tensors as its own (a swap) instead of copying them into its own — a
    pass over the weights after the last byte arrived, which the wire does not pay. Any other
    mapping may be written later by whoever handed it over: an engine copies it."""


C = TypeVar("C", bound=SyncFields)
"""The config member of a subscriber's transport."""

POLL_S = 0.2
"""Idle loops look at Redis this often; the pub/sub doorbell makes most wake-ups immediate."""

_OUTAGE_LOG_EVERY_S = 5.0


class _LoopErrors:
    """Logs a background loop's failures: a traceback for a bug, but one line at most every few
    seconds while Redis is unreachable — the loop retries every POLL_S meanwhile."""

    def __init__(self, what: str) -> None:
        self._what = what
        self._next = 0.0

    def __call__(self, exc: Exception) -> None:
        from redis.exceptions import ConnectionError, TimeoutError

        if not isinstance(exc, ConnectionError | TimeoutError):
            log.exception("%s", self._what)
        elif (now := time.monotonic()) >= self._next:
            log.warning("%s: Redis unreachable (%s); retrying", self._what, exc)
            self._next = now + _OUTAGE_LOG_EVERY_S


@dataclass(frozen=True)
class SyncRecord:
    """What one delivery of one version cost (a coalesced version has none)."""

    version: int
    blocking_s: float
    """Trainer time spent in `publish()` (metric `weight_publish_blocking_seconds`); 0 for a
    resend of a version already staged, e.g. to a worker that joined."""
    sync_s: float
    """From the start of the send to its end, group forming included (`weight_sync_seconds`)."""
    bytes_sent: int
    """Payload bytes of the version; 0 when it reached no one (`weight_sync_bytes`)."""
    receivers: int | None
    """Subscribers that received it; None where the transport cannot know (store)."""
    ok: bool
    started: float
    """`time.monotonic()` at the start of the send, for overlap measurements."""
    ended: float
    delta: bool = False
    """Sent as a sparse delta (`asyncrl_weight_sync_deltas_total`), not in full."""

    def metrics(self) -> dict[str, float]:
        return {
            "weight_publish_blocking_seconds": self.blocking_s,
            "weight_sync_seconds": self.sync_s,
            "weight_sync_bytes": float(self.bytes_sent),
        }


@dataclass
class PublisherStats:
    published: int = 0
    """Versions handed to `publish()`."""
    sent: int = 0
    """Deliveries that succeeded (resends included)."""
    coalesced: int = 0
    """Versions replaced by a newer one before their send began."""
    failed: int = 0
    """Deliveries that failed; the version is resent or superseded."""
    rebuilds: int = 0
    """Groups formed after the first one (membership changed or a send failed)."""
    last: SyncRecord | None = None


class WeightPublisher(Protocol):
    """Trainer rank 0's end. Thread-safe; `publish` is meant to be called after each step."""

    def publish(self, params: Params, version: int, *, defer_copy: bool = False) -> float:
        """Stage `params` as `version` (strictly increasing); returns the seconds it blocked.
        With `defer_copy` it returns before `params` are copied: call `copied()` before
        changing them."""
        ...

    def copied(self) -> float:
        """Return once the parameters of a deferred copy are copied (at once if none is
        pending); the seconds it blocked."""
        ...

    def stats(self) -> PublisherStats: ...

    @property
    def rebuilds(self) -> int: ...

    def close(self) -> None:
        """Send what is staged (bounded by the sync timeout), then release everything."""
        ...


class WeightSubscriber(Protocol):
    """A rollout worker's end: receives on its own thread and hands weights to `on_weights`."""

    @property
    def version(self) -> int | None:
        """Version of the last weights handed over; None before the first."""
        ...

    def wait_for_version(self, min_version: int, timeout_s: float) -> int:
        """Block until weights ≥ `min_version` were handed over; TimeoutError after `timeout_s`.
        A new worker calls `wait_for_version(0, ...)` so that it generates with the latest."""
        ...

    def close(self) -> None:
        """Leave cleanly: the publisher drops this worker before its next send."""
        ...


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def floating_dtype(name: object) -> torch.dtype | None:
    """The floating dtype a subscriber declared by name; None for anything else."""
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    return dtype if isinstance(dtype, torch.dtype) and dtype.is_floating_point else None


def text(value: bytes | str) -> str:
    """Redis replies as str, whether or not the client decodes responses."""
    return value.decode() if isinstance(value, bytes) else value


def read_hash(client: redis.Redis, key: str) -> dict[str, str]:
    return {text(k): text(v) for k, v in client.hgetall(key).items()}


def announce(client: redis.Redis, keys: Keys, **fields: str) -> None:
    """Set fields of the `weights` hash and ring the doorbell, in one transaction."""
    pipe = client.pipeline(transaction=True)
    pipe.hset(keys.weights, mapping=fields)  # type: ignore[arg-type]
    pipe.publish(keys.weights, ",".join(fields))
    pipe.execute()


class Doorbell:
    """Wakes a loop as soon as the `weights` hash changes (PUBLISH on the channel of the same
    name). Messages are only hints — the hash is the truth and is re-read after every wake-up —
    so the timeout turns a lost message (e.g. across a reconnect) into a poll."""

    def __init__(self, client: redis.Redis, channel: str) -> None:
        self._pubsub = client.pubsub(ignore_subscribe_messages=True)
        self._pubsub.subscribe(channel)

    def wait(self, timeout_s: float) -> None:
        if self._pubsub.get_message(timeout=timeout_s) is not None:
            while self._pubsub.get_message(timeout=0) is not None:
                pass

    def close(self) -> None:
        self._pubsub.close()


def _named(params: Params) -> list[tuple[str, torch.Tensor]]:
    if isinstance(params, torch.nn.Module):
        return list(params.named_parameters())
    return list(params)


class BackgroundPublisher(ABC):
    """Double-buffered staging and a sender thread; subclasses say how a buffer is delivered."""

    def __init__(
        self,
        staging_device: torch.device,
        on_record: Callable[[SyncRecord], None] | None,
        close_timeout_s: float,
    ) -> None:
        self._staging_device = staging_device
        self._on_record = on_record
        self._close_timeout_s = close_timeout_s
        self._cond = threading.Condition()
        self._back: FlatBuffer | None = None  # publish() fills it
        self._front: FlatBuffer | None = None  # the sender's: being sent, or last sent
        self._spare: FlatBuffer | None = None  # replaces the front of an older layout
        self._staged: tuple[int, float] | None = None  # (version, blocking_s) waiting in _back
        self._staged_copies: torch.Event | None = None  # completes when _back is filled
        self._deferred: list[tuple[str, torch.Tensor]] | None = None  # to copy into _back
        self._copying = False  # the sender is copying a deferred version into _front
        # A deferred copy the transport's `_send` finishes bucket by bucket (`_packed_through`)
        # as it posts them, when it says `_streams_copy`; otherwise it is done before `_send`.
        self._packer: Packer | None = None
        self._streams_copy = False
        self._front_version: int | None = None
        self._last_version: int | None = None
        # Set by a transport that knows what its receivers keep (see the module docstring);
        # read by `publish()` when it lays out the next version.
        self._narrow_to: torch.dtype | None = None
        self._closing = False
        self._sent_delta = False  # set by a transport's `_send` that sent a delta
        self._stats = PublisherStats()
        self._formed = 0  # groups formed by a transport that forms them
        self._thread = threading.Thread(target=self._run, name="weights-publisher", daemon=True)
        self._loop_errors = _LoopErrors("weight publisher: sender loop error")

    def _start(self) -> None:
        self._thread.start()

    @abstractmethod
    def _send(self, buffer: FlatBuffer, version: int) -> tuple[int, int | None]:
        """Deliver `buffer` as `version`; return (bytes sent, receivers). Raise on failure."""

    def _wants_resend(self) -> bool:
        """Polled while idle, from before the first version on (a transport may refresh what it
        knows of its receivers here): should the front (last sent) version, if any, go out
        again?"""
        return False

    def _packed_through(self, end: int) -> None:
        """Make sure bytes [0, end) of the front buffer hold the version being sent: the part
        of a deferred copy not done yet is done now, on the sender thread."""
        if self._packer is None:
            return
        assert self._front is not None
        self._packer.through(end)
        if end >= self._front.layout.total_bytes:
            self._packer = None
            self._copy_done()

    def _copy_done(self) -> None:
        with self._cond:
            self._copying = False
            self._cond.notify_all()

    @abstractmethod
    def _shutdown(self) -> None:
        """Release transport resources; runs on the sender thread after its last send."""

    def publish(self, params: Params, version: int, *, defer_copy: bool = False) -> float:
        start = time.perf_counter()
        named = _named(params)
        with self._cond:
            if self._closing:
                raise RuntimeError("publish() after close()")
            if self._last_version is not None and version <= self._last_version:
                raise ValueError(f"version {version} is not above {self._last_version}")
            layout = Layout.of(named, self._narrow_to)
            if self._back is None or self._back.layout != layout:
                # A new layout (the first publish, too) gets both buffers at once: left to the
                # next publish, the second one's first-touch page faults would cost more than
                # its copy.
                self._back = FlatBuffer(layout, self._staging_device)
                self._spare = FlatBuffer(layout, self._staging_device)
            # A deferred copy not begun yet is superseded: it would go into the same buffer.
            self._deferred = named if defer_copy else None
            if not defer_copy:
                self._staged_copies = self._copy(self._back, named)
            blocking_s = time.perf_counter() - start
            if self._staged is not None:
                self._stats.coalesced += 1
            self._staged = (version, blocking_s)
            self._last_version = version
            self._stats.published += 1
            self._cond.notify_all()
        return blocking_s

    def copied(self) -> float:
        start = time.perf_counter()
        with self._cond:
            if self._deferred is not None:  # the sender is busy: copy here, as publish() would
                assert self._back is not None
                self._staged_copies = self._copy(self._back, self._deferred)
                self._deferred = None
            self._cond.wait_for(lambda: not self._copying)
        return time.perf_counter() - start

    def _copy(
        self, buffer: FlatBuffer, named: list[tuple[str, torch.Tensor]]
    ) -> torch.Event | None:
        """Fill `buffer`; the event that completes with the copies. On an accelerator they are
        only queued, behind the optimizer step and ahead of the next one: the trainer goes on,
        the sender waits for the event."""
        buffer.pack(named)
        return copies_done(self._staging_device)

    def stats(self) -> PublisherStats:
        with self._cond:
            return dataclasses.replace(self._stats)

    @property
    def rebuilds(self) -> int:
        return self._stats.rebuilds

    def _group_formed(self) -> None:
        """Count a group a transport formed: each after the first is a rebuild."""
        if self._formed:
            with self._cond:
                self._stats.rebuilds += 1
        self._formed += 1

    def close(self) -> None:
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._thread.join(self._close_timeout_s)
        if self._thread.is_alive():
            log.error("weight publisher: sender still busy after %.0fs", self._close_timeout_s)

    def _next_job(self) -> tuple[int, float] | None:
        """Swap in the newest staged version; None when there is none (or when closing)."""
        with self._cond:
            self._cond.wait_for(lambda: self._staged is not None or self._closing, POLL_S)
            if self._staged is None:
                return None
            front, self._back = self._back, self._front
            assert front is not None  # a staged version lives in it
            if self._back is None or self._back.layout != front.layout:
                self._back, self._spare = self._spare, None
            self._front = front
            job, self._staged = self._staged, None
            self._front_version = job[0]
            deferred, self._deferred = self._deferred, None
            self._copying = deferred is not None
            copies, self._staged_copies = self._staged_copies, None
        # Only host copies are worth streaming: on an accelerator they are queued in no time.
        stream = self._streams_copy and front.flat.device.type == "cpu"
        if deferred is not None:
            try:
                if stream:
                    self._packer = Packer(front, deferred)  # `_deliver` completes it
                else:
                    copies = self._copy(front, deferred)
            finally:
                if self._packer is None:
                    self._copy_done()
        if copies is not None:
            copies.synchronize()
        return job

    def _run(self) -> None:
        while True:
            try:
                job = self._next_job()
                if job is not None:
                    self._deliver(*job)
                elif self._closing:
                    break
                elif self._wants_resend() and self._front_version is not None:
                    self._deliver(self._front_version, 0.0)
            except Exception as exc:
                # The thread must outlive Redis hiccups and bugs alike: log, pause, go on.
                self._loop_errors(exc)
                time.sleep(POLL_S)
        try:
            self._shutdown()
        except Exception:
            log.exception("weight publisher: shutdown failed")

    def _deliver(self, version: int, blocking_s: float) -> None:
        assert self._front is not None
        started = time.monotonic()
        self._sent_delta = False
        try:
            bytes_sent, receivers = self._send(self._front, version)
            ok = True
        except RuntimeError as exc:  # c10d and I/O failures: expected, handled by a resend
            log.warning("weight publisher: delivery of version %d failed: %s", version, exc)
            bytes_sent, receivers, ok = 0, 0, False
        except Exception as exc:
            self._loop_errors(exc)
            bytes_sent, receivers, ok = 0, 0, False
        finally:
            # Whatever the send did, the front must hold the version: it may be resent, and the
            # trainer waits in `copied()` for the copy to end.
            self._packed_through(self._front.layout.total_bytes)
        ended = time.monotonic()
        record = SyncRecord(
            version,
            blocking_s,
            ended - started,
            bytes_sent,
            receivers,
            ok,
            started,
            ended,
            delta=ok and self._sent_delta,
        )
        with self._cond:
            if ok:
                self._stats.sent += 1
            else:
                self._stats.failed += 1
            self._stats.last = record
        if self._on_record is not None:
            self._on_record(record)


class BackgroundSubscriber(ABC, Generic[C]):
    """A receive thread that hands weights over, tracks the version and answers waiters.

    Subclasses add their own state in `_setup`; the thread starts after it."""

    def __init__(
        self,
        cfg: C,
        client: redis.Redis,
        keys: Keys,
        worker_id: str,
        device: torch.device,
        on_weights: OnWeights,
        keeps_dtype: torch.dtype | None = None,
    ) -> None:
        self._client, self._keys, self._id, self._device = client, keys, worker_id, device
        self._on_weights = on_weights
        self._keeps_dtype = keeps_dtype
        self._close_timeout_s = 3 * cfg.sync_timeout_s
        self._doorbell = Doorbell(client, keys.weights)
        self._cond = threading.Condition()
        self._version: int | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="weights-subscriber", daemon=True)
        self._loop_errors = _LoopErrors("weight subscriber: receive loop error")
        self._setup(cfg)
        self._thread.start()

    @abstractmethod
    def _setup(self, cfg: C) -> None:
        """The transport's own state, from its config member; called before the thread starts."""

    @abstractmethod
    def _step(self) -> None:
        """Wait briefly for news and act on it; called in a loop until close()."""

    @abstractmethod
    def _leave(self) -> None:
        """Release transport resources after the loop ended."""

    @property
    def version(self) -> int | None:
        return self._version

    def wait_for_version(self, min_version: int, timeout_s: float) -> int:
        def reached() -> bool:
            return self._version is not None and self._version >= min_version

        with self._cond:
            if not self._cond.wait_for(reached, timeout_s):
                raise TimeoutError(f"no weights of version ≥ {min_version} within {timeout_s}s")
            assert self._version is not None
            return self._version

    def close(self) -> None:
        self._stop.set()
        self._thread.join(self._close_timeout_s)
        self._leave()

    def _hand_over(self, tensors: dict[str, torch.Tensor], version: int) -> None:
        self._on_weights(tensors, version)
        with self._cond:
            self._version = version
            self._cond.notify_all()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._step()
            except Exception as exc:
                self._loop_errors(exc)
                self._stop.wait(POLL_S)
