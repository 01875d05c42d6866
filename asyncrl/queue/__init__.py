"""The durable queue: Redis streams read through consumer groups (DESIGN §3, §9).

Delivery is at least once; the effect of an entry is exactly once because everything a consumer
does with an entry is committed by `Consumer.ack` in one server-side transaction that first checks
that this consumer still owns the entry. The rules:

- A consumer that (re)starts under the same name first gets the entries it still holds (its own
  pending entries), then new ones.
- Entries of a consumer whose heartbeat has expired are taken over once they have been idle for
  `claim_idle_s` (XPENDING with IDLE, filtered by `is_alive`, then XCLAIM; never a blind
  XAUTOCLAIM). Entries of a live consumer are never taken, however long it holds them: the
  trainer keeps its entries unacked until a checkpoint that includes them is durable. After a
  Redis outage a consumer waits `claim_idle_s` before claiming, so that live peers whose
  heartbeats lapsed while Redis was down can beat again.
- An entry delivered more than `max_deliveries` times, deleted while pending, or rejected by the
  decoder goes to the dead-letter stream with a reason, and is acked, in one transaction.
- Where entries belong to groups kept open in a hash (`Groups`: the run's released prompt
  groups), an entry whose group is not open, or is claimed by another entry, is dead-lettered
  on delivery; acks and dead letters end the group in the same transaction.
- A worker that stops without acking (SIGTERM, crash) leaves its entries pending: it gets them
  back if it restarts under its name, otherwise another consumer takes them over once its
  heartbeat has expired. There is no explicit release.
- Streams are trimmed only below what every group has acked.
- Every call survives Redis outages (reconnect with capped backoff) and a full Redis (producers
  pause below `maxmemory`); neither raises. `should_stop` ends such a wait with `Stopped`.
- Dead letters are for inspection, not a second queue: each keeps a bounded prefix of its entry
  and the stream only the newest ones. A full Redis takes them without the entry's fields (or
  not at all), never making them wait: acking junk is how memory is freed.
- A consumer group that vanished (Redis restarted empty) fails no call: acks of the entries it
  held are not applied, and the next read recreates it.

The modules: `config` (`queue.*`), `entries` (what an entry, a delivery and a group are),
`scripts` (the server-side transactions), `stream` (what a producer and a consumer of one stream
share), `producer`, `consumer` (read and claim) and `settle` (ack, settle, drop, dead letters).
Every call waits out outages through a `RedisGuard` (`asyncrl.redis_conn`): the role's, passed
as `guard=`.

redis is imported lazily: the config tree imports `QueueConfig`, and `asyncrl --help` must not pay
for redis-py.
"""

from asyncrl.queue.config import QueueConfig
from asyncrl.queue.consumer import Consumer, trim_acked
from asyncrl.queue.entries import Delivery, EntryFields, Groups, RawFields, entry_size
from asyncrl.queue.producer import Producer
from asyncrl.queue.settle import dead_letter_payload, dead_letter_summary

__all__ = [
    "Consumer",
    "Delivery",
    "EntryFields",
    "Groups",
    "Producer",
    "QueueConfig",
    "RawFields",
    "dead_letter_payload",
    "dead_letter_summary",
    "entry_size",
    "trim_acked",
]
