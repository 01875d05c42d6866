"""Valid trajectory groups, for the tests that feed a trainer's stream by hand and those that
build groups of their own samples."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from asyncrl.protocol import Sample, TrajectoryGroup

VERSION = 10  # the trainer's current version in the dead-letter tests


def group_of(
    samples: list[Sample], prompt_ids: Sequence[int] = (1, 5, 6, 13, 7, 8, 14), **fields: Any
) -> TrajectoryGroup:
    """A group of `samples` after `prompt_ids`; `fields` change the rest (by default: run "r",
    group "1-0" of prompt "p" released at version 0, worker "w", created and finished at 0)."""
    ids = np.array(prompt_ids, np.int32)
    group = TrajectoryGroup("r", "1-0", "p", 0, "w", 0.0, 0.0, ids, samples)
    return dataclasses.replace(group, **fields)


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
    group = group_of(
        [Sample(**sample_fields), bad],
        run="dlq",
        group_id=gid,
        prompt_id=gid,
        release_version=VERSION - 1,
    )
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
    return group_of([sample, sample], run="stop", group_id=gid, prompt_id=gid)
