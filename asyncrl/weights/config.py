"""Config of the weight-sync seam's own transports (DESIGN §7), each with only its own fields. The
union they are members of, chosen by `type` (`broadcast` when absent), is assembled with the
config tree (`asyncrl.config.WeightsConfig`), beside SGLang's member. Imports no torch, so config
validation stays fast."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from asyncrl.weights.fields import BroadcastDeltaFields, DeltaFields, GroupFields, StoreFields


class BroadcastWeightsConfig(GroupFields):
    """Trainer rank 0 sends each version over a torch.distributed group made for weight sync
    only."""

    type: Literal["broadcast"] = "broadcast"
    """Weight-sync backend."""
    bucket_mb: int = Field(default=64, gt=0)
    """Size in MiB of one broadcast: the flat weight buffer goes out in slices of this size."""
    delta: BroadcastDeltaFields = Field(default_factory=BroadcastDeltaFields)
    """Sparse delta sync."""


class StoreWeightsConfig(StoreFields):
    """Trainer rank 0 writes safetensors files to `store_dir` that workers load — for preemptible
    pools and sites without a collective fabric."""

    type: Literal["store"] = "store"
    """Weight-sync backend."""
    delta: DeltaFields = Field(default_factory=DeltaFields)
    """Sparse delta sync: anchors are written as full files, the versions between them as
    delta files that a receiver applies in order from the newest anchor or from its own
    version."""
