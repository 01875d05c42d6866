"""Who receives weights: a subscriber's registration in the run's `weights` hash under a lease,
and the publisher's reading of the registrations whose lease holds. Every transport that sends
to registered receivers (the broadcast group, SGLang's servers) forms its membership from them.

    join:{id}      subscriber {id} wants weights (JSON: host, pid, incarnation — random per
                   subscriber —, and what its transport adds); it counts as live while the key
                   `{Keys.weights}:lease:{id}` exists (TTL lease_s, refreshed every lease_s/3)
    behind:{id}    the version of a delta subscriber {id} could not apply: it waits for an
                   anchor (`asyncrl.weights.delta`)
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
from typing import TYPE_CHECKING
from uuid import uuid4

import redis

from asyncrl.weights.base import read_hash

if TYPE_CHECKING:
    from asyncrl.runstate import Keys

log = logging.getLogger(__name__)


_PER_SUBSCRIBER = ("join", "ready", "behind")
"""Prefixes of a subscriber's own fields of the `weights` hash, removed when it leaves."""


def lease_key(keys: Keys, worker_id: str) -> str:
    return f"{keys.weights}:lease:{worker_id}"


class Lease:
    """A subscriber's registration: `join:{id}` in the weights hash, live while its lease key
    exists. Its own thread refreshes both every third of `lease_s`, so that a long receive or a
    slow callback never lets the lease lapse."""

    def __init__(
        self, client: redis.Redis, keys: Keys, worker_id: str, lease_s: float, info: dict
    ) -> None:
        self._client, self._keys, self._id, self._lease_s = client, keys, worker_id, lease_s
        # Host and pid may both repeat when a container restarts; the incarnation does not.
        record = {"host": socket.gethostname(), "pid": os.getpid(), "incarnation": uuid4().hex}
        self._info = json.dumps({**record, **info})
        self._stop = threading.Event()
        self._register(first=True)
        self._thread = threading.Thread(target=self._beat, name="weights-lease", daemon=True)
        self._thread.start()

    def _register(self, *, first: bool = False) -> None:
        pipe = self._client.pipeline(transaction=True)
        pipe.set(lease_key(self._keys, self._id), "1", px=int(self._lease_s * 1000))
        pipe.hset(self._keys.weights, f"join:{self._id}", self._info)
        if first:
            # A predecessor under this id (killed, restarted) may have left its readiness: the
            # publisher would take this process for a member that holds the weights.
            pipe.hdel(self._keys.weights, f"ready:{self._id}", f"behind:{self._id}")
        pipe.execute()

    def _beat(self) -> None:
        while not self._stop.wait(self._lease_s / 3):
            try:
                self._register()
            except redis.RedisError as exc:
                log.warning("weights lease of %s not refreshed: %s", self._id, exc)

    def end(self) -> None:
        """Unregister at once (with the subscriber's readiness), so that no epoch is proposed to
        a subscriber that is leaving."""
        self._stop.set()
        self._thread.join()
        pipe = self._client.pipeline(transaction=True)
        pipe.delete(lease_key(self._keys, self._id))
        pipe.hdel(self._keys.weights, *(f"{p}:{self._id}" for p in _PER_SUBSCRIBER))
        pipe.execute()


def join_record(join: str) -> dict:
    """A `join:` record; one that does not parse declares nothing."""
    try:
        record = json.loads(join)
    except ValueError:
        return {}
    return record if isinstance(record, dict) else {}


def leased(client: redis.Redis, keys: Keys, workers: list[str]) -> list[bool]:
    """Whether each of `workers` holds its lease now."""
    pipe = client.pipeline(transaction=False)
    for worker in workers:
        pipe.exists(lease_key(keys, worker))
    return [bool(alive) for alive in pipe.execute()]


def live_joins(client: redis.Redis, keys: Keys) -> tuple[dict[str, str], dict[str, str]]:
    """The `join:` records of the subscribers whose lease holds, by id in id order, and the
    `weights` hash they were read from. Registrations whose lease lapsed are removed on the way
    (with the readiness a broadcast subscriber may have left)."""
    h = read_hash(client, keys.weights)
    joins = {f.removeprefix("join:"): v for f, v in h.items() if f.startswith("join:")}
    joined = sorted(joins)
    alive = leased(client, keys, joined)
    gone = [w for w, a in zip(joined, alive, strict=True) if not a]
    if gone:
        client.hdel(keys.weights, *(f"{p}:{w}" for w in gone for p in _PER_SUBSCRIBER))
    return {w: joins[w] for w, a in zip(joined, alive, strict=True) if a}, h
