"""What the trainer measures of the groups it did and did not train: the length bias (every
run) and the tokens the lag limit left out of the loss.

"Generated" here is every group delivered to the trainer, trained or dropped; "trained" the
groups a step took. Under `algo.stale_policy: train` the two are the same groups and the
statistic is 0; under `drop` the dropped groups are the slow ones. Groups a rollout worker gave
up in flight under `drop` never reach the trainer (their count is
`asyncrl_rollout_groups_dropped_stale_total`), so there the figure is a lower bound.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from asyncrl.algo.staleness import episode_turns, ks_statistic, token_lag_keep

if TYPE_CHECKING:
    from asyncrl.protocol import TrajectoryGroup

MEASURES = ("turns", "tokens", "seconds")
WINDOW_STEPS = 1000
"""Steps the run-level statistic looks back over: its sort stays a few milliseconds per step in
a run of any length."""

Length = tuple[int, int, float]


def group_length(group: TrajectoryGroup) -> Length:
    """(turns, tokens, seconds) of a group: its longest episode's turns and response tokens
    (observations included) and the group's wall time from its episodes' start to publishing —
    a group waits for its slowest episode."""
    turns = max((episode_turns(s.loss_mask) for s in group.samples), default=0)
    tokens = max((len(s.response_ids) for s in group.samples), default=0)
    return turns, tokens, max(group.finished_at - group.created_at, 0.0)


@dataclass
class LengthBias:
    """The lengths of the groups generated and trained in each of the trainer's last
    `WINDOW_STEPS` steps (since it started)."""

    steps: deque[tuple[list[Length], list[Length]]] = field(
        default_factory=lambda: deque(maxlen=WINDOW_STEPS)
    )
    """(generated, trained) of each step."""

    def step(
        self, trained: list[TrajectoryGroup], dropped: list[TrajectoryGroup]
    ) -> dict[str, float | None]:
        """The step record's figures: mean lengths of the step's groups generated (trained and
        dropped) and trained, and `length_bias_ks`, the largest of the three measures' KS
        statistics over the run so far (its last `WINDOW_STEPS` steps)."""
        took = [group_length(g) for g in trained]
        made = took + [group_length(g) for g in dropped]
        self.steps.append((made, took))
        generated = [r for m, _ in self.steps for r in m]
        trained_all = [r for _, t in self.steps for r in t]
        figures: dict[str, float | None] = {}
        for i, name in enumerate(MEASURES):
            for side, rows in (("generated", made), ("trained", took)):
                figures[f"episode_{name}_{side}"] = (
                    float(np.mean([r[i] for r in rows])) if rows else None
                )
        figures["length_bias_ks"] = max(
            ks_statistic([r[i] for r in generated], [r[i] for r in trained_all])
            for i in range(len(MEASURES))
        )
        return figures


def lag_masked_fraction(groups: list[TrajectoryGroup], version: int, max_lag: int) -> float:
    """Fraction of the groups' trained tokens (loss mask 1) older than `max_lag` versions: those
    `group_rows(token_lag=...)` leaves out of the loss."""
    total = old = 0
    for g in groups:
        for s in g.samples:
            on = np.ones(len(s.versions), bool) if s.loss_mask is None else s.loss_mask > 0
            total += int(on.sum())
            old += int((on & (token_lag_keep(s.versions, version, max_lag) == 0)).sum())
    return old / total if total else 0.0
