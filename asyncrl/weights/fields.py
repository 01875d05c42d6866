"""Fields shared by the members of the weights union (`asyncrl.weights.config`), SGLang's
included. A module of its own so that `asyncrl.sglang.config` can build on them while the union
imports it. Imports no torch."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field

from asyncrl.configbase import Section


class SyncFields(Section):
    type: str
    """Weight-sync backend; each member fixes it (declared here so that it comes first)."""
    sync_timeout_s: float = Field(default=30.0, gt=0)
    """Longest wait on subscribers in any one step of a sync (group forming, one bucket): a dead or
    hung subscriber delays the next version at most this long and never blocks the trainer."""
    lease_s: float = Field(default=5.0, gt=0)
    """A subscriber refreshes its lease every third of this; one whose lease lapses (killed,
    stopped, partitioned) is dropped from the group at the next version boundary."""


class GroupFields(SyncFields):
    """A collective group of trainer rank 0 and the receivers, formed over a TCPStore."""

    master_addr: str = "127.0.0.1"
    """Address at which subscribers reach the trainer's TCPStore (broadcast rendezvous). The
    store listens on this address only (it has no authentication), so it must be one of trainer
    rank 0's own: loopback for a single host, the pod's name or IP on Kubernetes."""
    master_port: int = Field(default=0, ge=0, le=65535)
    """Port of that TCPStore; 0 picks a free one (announced in the `weights` hash)."""
    backend: Literal["auto", "gloo", "nccl", "hccl"] = "auto"
    """Collective backend of the broadcast group. `auto`: from the device — cpu → gloo,
    cuda → nccl, npu → hccl."""


class StoreFields(SyncFields):
    """Versions written as files to a directory the receivers can read."""

    store_dir: Path | None = None
    """Shared directory of the `store` transport. Unset: `{run.dir}/weights`, resolved by the
    caller. A subscriber with it set reads files there, whatever path the trainer announced."""
    keep_last: int = Field(default=3, ge=1)
    """Versions kept in `store_dir`; older files are deleted after each write."""


class DeltaFields(Section):
    """Sparse delta sync (`asyncrl.weights.delta`): per version only the words that changed in
    the engine's dtype, against the version every receiver holds, with a full version (an
    anchor) every `anchor_every` versions and whenever a receiver lacks the base."""

    enabled: bool = False
    """Send deltas. Off: every version goes in full, as before. On, the trainer's host and each
    receiver keep one more copy of the weights in the engine's dtype."""
    anchor_every: int = Field(default=20, ge=1)
    """A full version after at most this many versions sent (1: always full)."""
    max_fraction: float = Field(default=0.5, gt=0, le=1)
    """A delta larger than this fraction of the full version is not sent: the version goes in
    full (`asyncrl_weight_sync_deltas_total` then stops counting)."""


class BroadcastDeltaFields(DeltaFields):
    pull_dir: Path | None = None
    """Also write every version sent (anchors in full, deltas as deltas) here, a directory the
    receivers can read: one that joins or falls behind pulls the versions it lacks from it by
    number while the group goes on with deltas. Each version is written before it is sent, so
    an anchor costs its sync a file write of the full version too; two anchors and the deltas
    after them are kept. Unset: such a receiver asks for an anchor, which then goes to the
    whole group."""
