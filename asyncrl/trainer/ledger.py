"""The trainer's durability ledger: which trained entries may be acked, and when (DESIGN §9).

A step's trajectory entries stay pending on this rank's consumer (`trainer-{rank}`) until a
checkpoint that includes the step is on disk; only then are they acked and counted as trained.
A trainer killed between checkpoints restarts from the last one, re-reads its pending entries
first and trains on them again, so each trajectory shapes the surviving model exactly once.

- `record(ids)`: the entries of a step that has run join the unacked list (entries of a step cut
  short by a stop never do: they stay pending, re-read after a restart);
- `covered()`: collective; every rank's unacked ids by consumer name, complete on rank 0, to be
  written into the checkpoint;
- `checkpointed(settle)`: the checkpoint holding those steps is durable; ack them as trained;
- `ack_covered_at_restart()`: rank 0 at restart acks the entries the checkpoint it resumed from
  covers whose ack did not happen before the previous trainer died, on behalf of all ranks,
  including ranks that no longer exist.

With several ranks the ids travel as JSON in byte tensors padded to the longest: nothing is
pickled.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from asyncrl.runstate import Counter

if TYPE_CHECKING:
    import redis

    from asyncrl.lease import Lease
    from asyncrl.protocol import TrajectoryGroup
    from asyncrl.queue import Consumer
    from asyncrl.redis_conn import RedisGuard
    from asyncrl.trainer.admission import Admission
    from asyncrl.trainer.parallel import Ranks

log = logging.getLogger("asyncrl.trainer")

Settle = Callable[[list[str], str], object]
"""Settles entry ids with an outcome (a counter name), as `Consumer.settle` does."""


def consumer_name(rank: int) -> str:
    """The stable trajectory consumer of a trainer rank (DESIGN §3)."""
    return f"trainer-{rank}"


class Ledger:
    def __init__(
        self,
        consumer: Consumer[TrajectoryGroup],
        ranks: Ranks,
        redis_guard: RedisGuard,
        client: redis.Redis,
        *,
        admission: Admission | None = None,
        lease: Lease | None = None,
        covered_at_restart: dict[str, list[str]] | None = None,
    ) -> None:
        """`admission`: rank 0's, through which entries are settled; `lease`: rank 0's hold on
        the run, checked before each settle; `covered_at_restart`: the ids by consumer that the
        checkpoint resumed from covers (rank 0; empty elsewhere)."""
        self.consumer, self.ranks, self.admission = consumer, ranks, admission
        self.lease = lease
        self.redis, self.client = redis_guard, client
        self.covered_at_restart = covered_at_restart or {}
        self.unacked: list[str] = []
        """Entry ids of the steps run since the last checkpoint, this rank's."""

    def record(self, ids: list[str]) -> None:
        """The step these entries were trained in has run."""
        self.unacked.extend(ids)

    def covered(self) -> dict[str, list[str]]:
        """Every rank's unacked ids by consumer name, complete on rank 0. Collective."""
        world = self.ranks.world
        if world is None:
            return {self.consumer.name: list(self.unacked)}
        data = torch.frombuffer(bytearray(json.dumps(self.unacked).encode()), dtype=torch.uint8)
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.ranks.size)]
        dist.all_gather(sizes, torch.tensor([data.numel()]), group=world)
        longest = max(int(n) for n in sizes)
        padded = torch.zeros(longest, dtype=torch.uint8)
        padded[: data.numel()] = data
        gathered = [torch.empty(longest, dtype=torch.uint8) for _ in range(self.ranks.size)]
        dist.all_gather(gathered, padded, group=world)
        return {
            consumer_name(r): json.loads(t[: int(n)].numpy().tobytes())
            for r, (t, n) in enumerate(zip(gathered, sizes, strict=True))
        }

    def checkpointed(self, settle: Settle) -> None:
        """A checkpoint holding every recorded step is on disk: ack their entries as trained
        through `settle` (the prefetcher's, which applies it on its reading thread)."""
        if self.unacked:
            settle(self.unacked, Counter.GROUPS_TRAINED)
            self.unacked = []

    def settle(self, ids: list[str], outcome: str) -> int:
        """`Consumer.settle`; on rank 0 through admission, which looks for a loss of Redis's data
        before each attempt (so that the entries held are kept in flight through it, not found
        gone) and counts what was settled in the counters it remembers. Nothing is settled once
        another trainer took the run: the entries are its to settle now (the lease stops this
        one)."""
        if self.lease is not None and not self.redis.call(self.lease.hold, "renew the lease"):
            return 0
        if self.admission is None:
            return self.consumer.settle(ids, outcome)

        def settle_checked(check: Callable[[], object]) -> int:
            return self.consumer.settle(ids, outcome, check=check)

        settle = partial(self.admission.settle, settle_checked, outcome)
        return self.redis.call(settle, f"settle entries as {outcome}")

    def ack_covered_at_restart(self) -> None:
        """Rank 0 at restart: ack the entries trained into the checkpoint resumed from whose ack
        did not happen before the previous trainer died. Each list is first taken over from its
        consumer (XCLAIM moves only ids still pending; those already acked are neither acked
        nor counted again), so this also serves ranks that no longer exist."""
        for consumer, ids in self.covered_at_restart.items():
            if ids:
                self._take_over(ids)
                settled = self.settle(ids, Counter.GROUPS_TRAINED)
                if settled:
                    log.info("acked %d entries of %s trained before the restart", settled, consumer)

    def _take_over(self, ids: list[str]) -> None:
        """Make those of `ids` still pending pending on this rank's consumer."""
        from redis import exceptions as rx

        c = self.consumer

        def claim() -> None:
            try:
                self.client.xclaim(c.stream, c.group, c.name, 0, list(ids), justid=True)
            except rx.ResponseError as exc:
                if "NOGROUP" not in str(exc):  # no group: Redis lost the entries with it
                    raise

        self.redis.call(claim, "take over trained entries")
