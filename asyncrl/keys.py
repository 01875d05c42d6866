"""Redis key names of one run (DESIGN §3). Every key lives under `asyncrl:{run_id}:`."""

from __future__ import annotations

from dataclasses import dataclass

# Run accounting fields of the `counters` hash. They count durable outcomes only, so at any quiet
# moment: prompts_released = groups_trained + groups_dropped_stale + groups_dead_lettered +
# groups_lost + HLEN(released). `entries_rejected` counts dead-lettered entries that ended no
# released group (junk, duplicates) and stays out of that sum; `groups_lost` the groups in flight
# when Redis lost its data (`asyncrl.trainer.admission`).
COUNTERS = (
    "prompts_released",
    "groups_published",
    "groups_trained",
    "groups_dropped_stale",
    "groups_dead_lettered",
    "groups_lost",
    "entries_rejected",
)

PROMPTS_GROUP = "rollout"
TRAJECTORIES_GROUP = "trainer"


@dataclass(frozen=True)
class Keys:
    run_id: str

    @property
    def prefix(self) -> str:
        return f"asyncrl:{self.run_id}:"

    @property
    def prompts(self) -> str:
        return self.prefix + "prompts"

    @property
    def trajectories(self) -> str:
        return self.prefix + "trajectories"

    @property
    def dlq(self) -> str:
        return self.prefix + "dlq"

    @property
    def version(self) -> str:
        return self.prefix + "version"

    @property
    def weights(self) -> str:
        return self.prefix + "weights"

    @property
    def counters(self) -> str:
        return self.prefix + "counters"

    @property
    def cursor(self) -> str:
        """Hash (seed, epoch, position) of the next prompt to release; moves with each release."""
        return self.prefix + "cursor"

    @property
    def released(self) -> str:
        """Hash of the prompt groups in flight: field = the prompts-stream entry id of a released
        prompt (the `group_id` of its trajectory group), value = "" until a trajectory entry
        claims it, then that entry's id. A group's field goes in the transaction that ends it
        (trained, dropped stale, dead-lettered); see `asyncrl.provenance`."""
        return self.prefix + "released"

    @property
    def last_step(self) -> str:
        """JSON of the trainer's latest step figures, for `asyncrl status`."""
        return self.prefix + "last_step"

    def worker(self, role: str, worker_id: str) -> str:
        return f"{self.prefix}workers:{role}:{worker_id}"

    def workers_pattern(self, role: str) -> str:
        return f"{self.prefix}workers:{role}:*"
