"""Admission control (trainer rank 0): how many prompt groups may be in flight, and releasing them.

Bound (DESIGN §5): released but not yet consumed groups ≤ (η + 1) × groups_per_step. The trainer
consumes exactly `groups_per_step` usable groups per step, and dropped, dead-lettered or lost
groups free their slot, so after `step` steps the release budget is

    (step + η + 1) × groups_per_step + dropped_stale + dead_lettered + lost − released.

Only dead letters that end a released group count (`asyncrl.provenance`): junk entries never buy
releases. Sync mode is η = 0: the next step's prompts are released only once the previous step is
done. The data cursor (seed, epoch, position) advances in the same Redis transaction that adds the
prompt, opens its group in `released` and counts it released, so a restarted trainer never
releases a prompt twice and never skips one, whatever checkpoint it restarts from.

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
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import redis

from asyncrl.keys import COUNTERS, Keys
from asyncrl.protocol import PromptGroup, encode_prompt
from asyncrl.queue import QueueConfig, entry_size
from asyncrl.tasks.base import Task

log = logging.getLogger(__name__)

# One release: each prompt added and its group opened in `released`, the releases counted and
# the cursor moved. KEYS: prompts, counters, cursor, released. ARGV: n, seed, epoch, position,
# then the n messages. An XADD is the first write, the only one Redis may refuse for memory: a
# full Redis rejects the whole release.
_RELEASE_LUA = """
local n = tonumber(ARGV[1])
for i = 1, n do
  local id = redis.call('XADD', KEYS[1], '*', 'data', ARGV[4 + i], 'schema', '1')
  redis.call('HSET', KEYS[4], id, '')
end
redis.call('HINCRBY', KEYS[2], 'prompts_released', n)
redis.call('HSET', KEYS[3], 'seed', ARGV[2], 'epoch', ARGV[3], 'position', ARGV[4])
return n
"""

# Seed the counters again, unless someone did already. KEYS: counters, released. ARGV: n, then
# n (field, value) pairs, then (group, entry id) pairs to open again for the entries holding them.
# HINCRBY, not HSET: what was counted since the loss (a junk dead letter) stays counted.
_RESEED_LUA = """
if redis.call('HEXISTS', KEYS[1], 'prompts_released') == 1 then return 0 end
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
    step: int, max_staleness: int, groups_per_step: int, counters: dict[str, int]
) -> int:
    """Prompt groups that may be released now (can be negative after a restart; treat as 0)."""
    freed = sum(
        counters.get(name, 0)
        for name in ("groups_dropped_stale", "groups_dead_lettered", "groups_lost")
    )
    allowed = (step + max_staleness + 1) * groups_per_step + freed
    return allowed - counters.get("prompts_released", 0)


def read_counters(client: redis.Redis, keys: Keys) -> dict[str, int]:
    raw = client.hgetall(keys.counters)
    return {k.decode(): int(v) for k, v in raw.items()}  # type: ignore[union-attr]


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
        counters: dict[str, int] | None = None,
        held: Callable[[], dict[str, str]] = dict,
        max_message_bytes: int = QueueConfig().max_message_bytes,
    ) -> None:
        """`counters`: the run counters as last known (a checkpoint's), to find a loss of Redis's
        data by; `held`: entry id → group of the trajectory entries the trainer holds, kept in
        flight through such a loss; `max_message_bytes` bounds each prompt entry."""
        self.client = client
        self.keys = keys
        self.task = task
        self.task_name = task_name
        self.n = n
        self.max_staleness = max_staleness
        self.groups_per_step = groups_per_step
        self.cursor = cursor
        self._items = task.train_items(cursor.seed, cursor.epoch)
        self._cursor_unknown = False
        self._lock = threading.Lock()
        self._max_message_bytes = max_message_bytes
        self._script = client.register_script(_RELEASE_LUA)
        self._reseed_script = client.register_script(_RESEED_LUA)
        self._held = held
        self._counters: dict[str, int] = dict(counters or {})
        """The counters as last read (and counted by this process since)."""

    def release(self, step: int, version: int) -> int:
        """Release as many groups as the bound allows now; returns how many. May be called again
        after it raised (a Redis outage): the transaction may or may not have been applied, so
        the cursor is then re-read from Redis, which holds the truth."""
        with self._lock:
            return self._release(step, version)

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
        budget = release_budget(step, self.max_staleness, self.groups_per_step, counters)
        if budget <= 0:
            return 0
        self._cursor_unknown = True  # until the transaction below is known to be applied
        messages = []
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
            data = encode_prompt(prompt)
            entry_size({"data": data, "schema": b"1"}, self._max_message_bytes)
            messages.append(data)
            self._advance()
        c = self.cursor
        self._script(
            keys=[self.keys.prompts, self.keys.counters, self.keys.cursor, self.keys.released],
            args=[budget, c.seed, c.epoch, c.position, *messages],
        )
        self._cursor_unknown = False
        counters["prompts_released"] = counters.get("prompts_released", 0) + budget
        return budget

    def settle(self, settle: Callable[[], int], outcome: str) -> int:
        """Run `settle` (the trainer settling entries as `outcome`), having looked for a loss of
        Redis's data first: the entries it settles are then still held, so kept in flight through
        the loss. What it counted joins the counters remembered, under the lock that reads them,
        so that a loss found right after it knows of it."""
        with self._lock:
            self._read()
            counted = settle()
            self._counters[outcome] = self._counters.get(outcome, 0) + counted
            return counted

    def _read(self) -> dict[str, int]:
        """The counters now, seeded again first if Redis lost them."""
        counters = read_counters(self.client, self.keys)
        if "prompts_released" not in counters and self._counters.get("prompts_released", 0):
            counters = self._reseed()
        self._counters = counters
        return counters

    def counters(self) -> dict[str, int]:
        """The counters as last read, for a checkpoint."""
        with self._lock:
            return dict(self._counters)

    def _reseed(self) -> dict[str, int]:
        """Redis lost the run's state: seed the counters from the last read; the counters now."""
        seed = {name: self._counters.get(name, 0) for name in COUNTERS}
        settled = ("groups_trained", "groups_dropped_stale", "groups_dead_lettered", "groups_lost")
        held = self._held()
        in_flight = seed["prompts_released"] - sum(seed[name] for name in settled)
        lost = max(0, in_flight - len(held))
        seed["groups_lost"] += lost
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
                seed["prompts_released"],
            )
        return read_counters(self.client, self.keys)

    def _advance(self) -> None:
        self.cursor.position += 1
        if self.cursor.position >= len(self._items):
            self.cursor.epoch += 1
            self.cursor.position = 0
            self._items = self.task.train_items(self.cursor.seed, self.cursor.epoch)
