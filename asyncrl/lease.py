"""The run's trainer lease: one trainer per run, by a key that holds its token.

Two trainers on one run would both be consumer `trainer-0`: both resume, release, publish and
ack, versions go out twice with different weights and the run stalls. So a trainer (its rank 0)
takes the key `trainer_lease` with SET NX before it touches the run, and its heartbeat renews it
(`asyncrl.heartbeat`). A lease found held is waited for while it runs down — a trainer killed
moments ago (SIGKILL) leaves its lease to expire within one TTL, and its successor takes it then —
and refused as soon as it is renewed (a live trainer renews it every third of the TTL).

Once taken, the lease fences the holder: a trainer that finds another token in the key (its lease
expired while it was frozen or cut off, and another trainer took the run) stops before it
publishes, acks or releases anything more. A key found gone (expired in an outage, or a Redis
restarted without its data) is taken again: nobody else holds the run.
"""

from __future__ import annotations

import logging
import os
import socket
import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import redis

log = logging.getLogger(__name__)

# KEYS: the lease. ARGV: token, TTL in ms. 1 when the token holds the lease now (renewed, or
# taken again from nobody), 0 when another token holds it.
_HOLD_LUA = """
local holder = redis.call('GET', KEYS[1])
if holder == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
if not holder then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return 1
end
return 0
"""

# KEYS: the lease. ARGV: token. Deletes it only while it is the token's.
_RELEASE_LUA = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


class LeaseError(Exception):
    """This process may not act as the run's trainer; the message is one line."""


class LeaseHeld(LeaseError):
    """A live trainer holds the run."""


class LeaseLost(LeaseError):
    """Another trainer took the run from this one."""


class Lease:
    def __init__(
        self,
        client: redis.Redis,
        key: str,
        ttl_s: float,
        on_lost: Callable[[], None] = lambda: None,
    ) -> None:
        """`on_lost` is called once, on the thread that finds the lease taken."""
        self._client = client
        self.key = key
        self._ttl_ms = max(1, int(ttl_s * 1000))
        self.token = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self._on_lost = on_lost
        self.lost = False
        self._hold = client.register_script(_HOLD_LUA)
        self._release = client.register_script(_RELEASE_LUA)

    def acquire(self) -> None:
        """Take the lease; wait while a holder's runs down (it died), raise `LeaseHeld` once it
        is renewed or taken by another (it lives)."""
        seen: tuple[str, int] | None = None
        poll_s = min(0.2, self._ttl_ms / 10_000)
        while not self._client.set(self.key, self.token, nx=True, px=self._ttl_ms):
            pipe = self._client.pipeline(transaction=True)
            pipe.get(self.key)
            pipe.pttl(self.key)
            raw, left = pipe.execute()
            if raw is None:
                continue  # expired since the SET: take it
            holder = raw.decode()
            if left < 0 or (seen is not None and (holder != seen[0] or left > seen[1])):
                raise LeaseHeld(
                    f"a live trainer ({holder}) holds this run: its lease {self.key} "
                    + ("has no expiry" if left < 0 else "was renewed while this one waited")
                    + "; stop it before starting another trainer on the run"
                )
            seen = (holder, left)
            time.sleep(poll_s)

    def hold(self) -> bool:
        """Renew the lease (or take it again from nobody); False once another holds it, for good:
        this process is no longer the run's trainer."""
        if self.lost:
            return False
        if self._hold(keys=[self.key], args=[self.token, self._ttl_ms]):
            return True
        self.lost = True
        holder = self._client.get(self.key)
        log.error(
            "another trainer (%s) took this run's lease %s: this trainer stops, publishing and "
            "acking nothing more",
            holder.decode() if isinstance(holder, bytes) else holder,
            self.key,
        )
        self._on_lost()
        return False

    def check(self) -> None:
        """Raise `LeaseLost` unless this process still holds the lease (renewing it)."""
        if not self.hold():
            raise LeaseLost(
                f"another trainer took this run (its lease {self.key}): stopped before "
                "publishing or acking anything more"
            )

    def release(self) -> None:
        """Give the lease back, so that a restart needs no wait; only while it is ours."""
        if not self.lost:
            self._release(keys=[self.key], args=[self.token])
