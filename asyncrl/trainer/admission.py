"""Admission control (trainer rank 0): how many prompt groups may be in flight, and releasing them.

Bound (DESIGN §5): released but not yet consumed groups ≤ (η + 1) × groups_per_step. The trainer
consumes exactly `groups_per_step` usable groups per step, and dropped or dead-lettered groups free
their slot, so after `step` steps the release budget is

    (step + η + 1) × groups_per_step + dropped_stale + dead_lettered − released.

Sync mode is η = 0: the next step's prompts are released only once the previous step is done.
The data cursor (seed, epoch, position) advances in the same Redis transaction that adds the
prompt and counts it released, so a restarted trainer never releases a prompt twice and never
skips one, whatever checkpoint it restarts from.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np
import redis

from asyncrl.keys import Keys
from asyncrl.protocol import PromptGroup, encode_prompt
from asyncrl.rollout.tasks import Task


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
    freed = counters.get("groups_dropped_stale", 0) + counters.get("groups_dead_lettered", 0)
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
    ) -> None:
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
        counters = read_counters(self.client, self.keys)
        budget = release_budget(step, self.max_staleness, self.groups_per_step, counters)
        if budget <= 0:
            return 0
        self._cursor_unknown = True  # until the transaction below is known to be applied
        pipe = self.client.pipeline(transaction=True)
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
            pipe.xadd(self.keys.prompts, {"data": encode_prompt(prompt), "schema": b"1"})
            self._advance()
        pipe.hincrby(self.keys.counters, "prompts_released", budget)
        pipe.hset(self.keys.cursor, mapping=dict(self.cursor.as_dict()))  # type: ignore[arg-type]
        pipe.execute()
        self._cursor_unknown = False
        return budget

    def _advance(self) -> None:
        self.cursor.position += 1
        if self.cursor.position >= len(self._items):
            self.cursor.epoch += 1
            self.cursor.position = 0
            self._items = self.task.train_items(self.cursor.seed, self.cursor.epoch)
