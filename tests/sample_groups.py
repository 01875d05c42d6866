"""Valid trajectory groups for the tests that feed a trainer's stream by hand."""

from __future__ import annotations

from typing import Any

import numpy as np

from asyncrl.protocol import Sample, TrajectoryGroup

VERSION = 10  # the trainer's current version in the dead-letter tests


def _group(run: str, gid: str, release_version: int, samples: list[Sample]) -> TrajectoryGroup:
    return TrajectoryGroup(
        run=run,
        group_id=gid,
        prompt_id=gid,
        release_version=release_version,
        worker="w",
        created_at=0.0,
        finished_at=0.0,
        prompt_ids=np.array([1, 5, 6, 13, 7, 8, 14], np.int32),
        samples=samples,
    )


def make_group(gid: str, **change: Any) -> TrajectoryGroup:
    """A valid group at staleness 1 from `VERSION`; `change` overrides sample 1's fields or the
    group's."""
    sample_fields: dict[str, Any] = {
        "response_ids": np.array([4, 5, 2], np.int32),
        "logprobs": np.array([-0.5, -1.0, -0.1], np.float32),
        "versions": np.array([VERSION - 1, VERSION - 1, VERSION], np.int32),
        "reward": 1.0,
        "finish": "stop",
    }
    group_change = {k: v for k, v in change.items() if k not in sample_fields}
    bad = Sample(**{**sample_fields, **{k: v for k, v in change.items() if k in sample_fields}})
    group = _group("dlq", gid, VERSION - 1, [Sample(**sample_fields), bad])
    for k, v in group_change.items():
        setattr(group, k, v)
    return group


def plain_group(gid: str) -> TrajectoryGroup:
    """A valid group generated at version 0, two equal samples."""
    sample = Sample(
        response_ids=np.array([4, 5, 2], np.int32),
        logprobs=np.array([-0.5, -1.0, -0.1], np.float32),
        versions=np.zeros(3, np.int32),
        reward=1.0,
        finish="stop",
    )
    return _group("stop", gid, 0, [sample, sample])
