"""Admission control (trainer rank 0): how many prompt groups may be in flight, and releasing them.

Bound (DESIGN §5): released but not yet consumed groups ≤ (η + 1) × groups_per_step. The trainer
consumes exactly `groups_per_step` usable groups per step, and dropped, dead-lettered or lost
groups free their slot, so with `consumed` the groups the steps so far took, the release budget is

    consumed + (η + 1) × groups_per_step + dropped_stale + dead_lettered + lost − released.

`consumed` is step × groups_per_step while G stays; a run resumed with another G counts on from
what its checkpoint's steps consumed (`TrainerState.groups_consumed`): the budget is rebased on
the new G, never left negative (the trainer would starve) or inflated by the steps already done.

Only dead letters that end a released group count (`asyncrl.provenance`): junk entries never buy
releases. Sync mode is η = 0: the next step's prompts are released only once the previous step is
done. The data cursor (seed, epoch, position) advances in the same Redis transaction that adds the
prompt, opens its group in `released` and counts it released, so a restarted trainer never
releases a prompt twice and never skips one, whatever checkpoint it restarts from. That
transaction is the prompts stream's producer's (`queue.Producer.add_counted`): it checks each
entry's size, and applies only while `prompts_released` still reads what the budget was computed
from, so a retry after a lost reply releases nothing twice. A full Redis gets no release, and the
release does not wait for memory: the reads that free it run on the thread that releases.

A Redis that comes back without its data (no AOF) has lost the counters, which would make the
budget a burst of (step + η + 1) × groups_per_step. Admission keeps the counters it last read
(at start, those of the checkpoint it resumes from, so a trainer started after the loss finds it
too) and, finding them gone, seeds them again (once, atomically): the groups then in flight are
gone with the streams and count as `groups_lost` — except those this trainer holds (read, or
trained and awaiting their checkpoint's ack), whose groups are opened again in `released` under
the entries that hold them, so that settling them (`Consumer.settle`) counts them as trained or
dropped as if nothing had happened. Groups other trainer ranks hold count as lost.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np
import redis

from asyncrl.protocol import PromptGroup, encode_prompt
from asyncrl.queue import EntryFields, Producer, QueueConfig
from asyncrl.redis_conn import RedisGuard
from asyncrl.runstate import Counter, Counters, Keys, read_counters
from asyncrl.tasks.base import Task

log = logging.getLogger(__name__)

# Seed the counters again, unless someone did already. KEYS: counters, released. ARGV: n, then
# n (field, value) pairs, then (group, entry id) pairs to open again for the entries holding them.
# HINCRBY, not HSET: what was counted since the loss (a junk dead letter) stays counted.
_RESEED_LUA = f"""
if redis.call('HEXISTS', KEYS[1], '{Counter.PROMPTS_RELEASED}') == 1 then return 0 end
local n = tonumber(ARGV[1])
for i = 2, 2 * n, 2 do
  redis.call('HINCRBY', KEYS[1], ARGV[i], ARGV[i + 1])
end
for i = 2 + 2 * n, #ARGV, 2 do
  redis.call('HSET', KEYS[2], ARGV[i], ARGV[i + 1])
end
return 1
"""


@dataclass
class Cursor:
    seed: int
    epoch: int = 0
    position: int = 0

    def as_dict(self) -> dict[str, int]:
        return {"seed": self.seed, "epoch": self.epoch, "position": self.position}


def release_budget(
    consumed: int, max_staleness: int, groups_per_step: int, counters: Counters
) -> int:
    """Prompt groups that may be released now, `consumed` groups into the run (can be negative
    after a restart, or after η was lowered; treat as 0)."""
    allowed = consumed + (max_staleness + 1) * groups_per_step + counters.freed
    return allowed - counters.prompts_released


def load_cursor(client: redis.Redis, keys: Keys, fallback: Cursor) -> Cursor:
    raw = client.hgetall(keys.cursor)
    if not raw:
        return fallback
    d = {k.decode(): int(v) for k, v in raw.items()}  # type: ignore[union-attr]
    return Cursor(seed=d["seed"], epoch=d["epoch"], position=d["position"])


class Admission:
    """Releases prompt groups from `task`'s train split into the `prompts` stream."""

    def __init__(
        self,
        client: redis.Redis,
        keys: Keys,
        task: Task,
        *,
        task_name: str,
        n: int,
        max_staleness: int,
        groups_per_step: int,
        cursor: Cursor,
        consumed_before: int = 0,
        counters: Mapping[str, int] | None = None,
        held: Callable[[], dict[str, str]] = dict,
        queue: QueueConfig | None = None,
        guard: RedisGuard | None = None,
    ) -> None:
        """`consumed_before`: the groups the steps consumed beyond step × `groups_per_step` (a
        run resumed with another G); `counters`: the run counters as last known (a
        checkpoint's), to find a loss of Redis's data by; `held`: entry id → group of the
        trajectory entries the trainer holds, kept in flight through such a loss; `queue`
        bounds each prompt entry and says when Redis is full; `guard` is the prompt producer's
        (`asyncrl.queue.Producer`)."""
        self.client = client
        self.keys = keys
        self.task = task
        self.task_name = task_name
        self.n = n
        self.max_staleness = max_staleness
        self.groups_per_step = groups_per_step
        self._consumed_before = consumed_before
        self.cursor = cursor
        self._items = task.train_items(cursor.seed, cursor.epoch)
        self._cursor_unknown = False
        self._lock = threading.Lock()
        self._producer = Producer(client, keys.prompts, queue, guard=guard)
        self._reseed_script = client.register_script(_RESEED_LUA)
        self._held = held
        self._counters = Counters.from_hash(counters or {})
        """The counters as last read (and counted by this process since)."""

    def release(self, step: int, version: int) -> int:
        """Release as many groups as the bound allows now; returns how many. May be called again
        after it raised (a Redis outage): the transaction may or may not have been applied, so
        the cursor is then re-read from Redis, which holds the truth."""
        with self._lock:
            return self._release(step, version)

    def groups_consumed(self, step: int) -> int:
        """The groups `step` steps of the run consumed."""
        return self._consumed_before + step * self.groups_per_step

    def cursor_dict(self) -> dict[str, int]:
        """The cursor after the last release (`release` may run on another thread)."""
        with self._lock:
            return self.cursor.as_dict()

    def _release(self, step: int, version: int) -> int:
        if self._cursor_unknown:
            self.cursor = load_cursor(self.client, self.keys, self.cursor)
            self._items = self.task.train_items(self.cursor.seed, self.cursor.epoch)
            self._cursor_unknown = False
        counters = self._read()
        consumed = self.groups_consumed(step)
        budget = release_budget(consumed, self.max_staleness, self.groups_per_step, counters)
        if budget <= 0:
            return 0
        self._cursor_unknown = True  # until the transaction below is known to be applied
        start = Cursor(**self.cursor.as_dict())
        entries: list[EntryFields] = []
        for _ in range(budget):
            item = self._items[self.cursor.position]
            prompt = PromptGroup(
                run=self.keys.run_id,
                prompt_id=item.prompt_id,
                prompt=item.prompt,
                prompt_ids=np.asarray(item.prompt_ids, np.int32),
                answer=item.answer,
                task=self.task_name,
                n=self.n,
                release_version=version,
            )
            entries.append({"data": encode_prompt(prompt), "schema": b"1"})
            self._advance()
        released = self._producer.add_counted(
            entries,
            counters_key=self.keys.counters,
            counter=Counter.PROMPTS_RELEASED,
            expected=counters.prompts_released,
            groups_key=self.keys.released,
            state=(self.keys.cursor, self.cursor.as_dict()),
        )
        self._cursor_unknown = False
        if not released:  # Redis is full, or lost its counters since they were read: not now
            self.cursor = start
            self._items = self.task.train_items(start.seed, start.epoch)
            return 0
        self._counters = counters.plus(Counter.PROMPTS_RELEASED, budget)
        return budget

    def settle(self, settle: Callable[[Callable[[], object]], int], outcome: str) -> int:
        """Run `settle` (the trainer settling entries as `outcome`), handing it the look for a
        loss of Redis's data to run before each of its attempts (`Consumer.settle`'s `check`):
        the entries it settles are then still held, so kept in flight through a loss, even one
        that happens while it waits out an outage. What it counted joins the counters
        remembered, under the lock that reads them, so that a loss found right after it knows
        of it."""
        with self._lock:
            counted = settle(self._read)
            self._counters = self._counters.plus(outcome, counted)
            return counted

    def _read(self) -> Counters:
        """The counters now, seeded again first if Redis lost them (releases only ever add to
        `prompts_released`: none counted where some were is a loss)."""
        counters = read_counters(self.client, self.keys)
        if not counters.prompts_released and self._counters.prompts_released:
            counters = self._reseed()
        self._counters = counters
        return counters

    def counters(self) -> dict[str, int]:
        """The counters as last read, for a checkpoint."""
        with self._lock:
            return self._counters.as_dict()

    def _reseed(self) -> Counters:
        """Redis lost the run's state: seed the counters from the last read; the counters now."""
        held = self._held()
        in_flight = self._counters.prompts_released - self._counters.ended
        lost = max(0, in_flight - len(held))
        seed = self._counters.plus(Counter.GROUPS_LOST, lost)
        args: list[str | int] = [len(seed)]
        for name, value in seed.items():
            args += [name, value]
        for entry_id, group in held.items():
            args += [group, entry_id]
        if self._reseed_script(keys=[self.keys.counters, self.keys.released], args=args):
            log.error(
                "Redis lost the run's state (its counters are gone: restarted without its data?); "
                "counters seeded from the last read: %d groups in flight at the loss counted "
                "lost, %d the trainer holds kept; %d prompts released so far",
                lost,
                len(held),
                seed.prompts_released,
            )
        return read_counters(self.client, self.keys)

    def _advance(self) -> None:
        self.cursor.position += 1
        if self.cursor.position >= len(self._items):
            self.cursor.epoch += 1
            self.cursor.position = 0
            self._items = self.task.train_items(self.cursor.seed, self.cursor.epoch)
