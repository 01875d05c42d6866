"""Weight sync between trainer rank 0 and the rollout workers (DESIGN §7).

Importing the package loads nothing: the configs import no torch (so configs validate without
it) and the builders and Protocols are loaded on first use:

    from asyncrl.weights import WeightsConfig, build_publisher, build_subscriber

Nothing is imported eagerly because `asyncrl.sglang.config` builds on `asyncrl.weights.fields`
while `asyncrl.weights.config` imports it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from asyncrl.weights.base import (
        PublisherStats,
        SyncRecord,
        WeightPublisher,
        WeightSubscriber,
        build_publisher,
        build_subscriber,
    )
    from asyncrl.weights.config import BroadcastWeightsConfig, StoreWeightsConfig, WeightsConfig

_HOME = {
    "BroadcastWeightsConfig": "config",
    "StoreWeightsConfig": "config",
    "WeightsConfig": "config",
    "PublisherStats": "base",
    "SyncRecord": "base",
    "WeightPublisher": "base",
    "WeightSubscriber": "base",
    "build_publisher": "base",
    "build_subscriber": "base",
}

__all__ = [
    "BroadcastWeightsConfig",
    "PublisherStats",
    "StoreWeightsConfig",
    "SyncRecord",
    "WeightPublisher",
    "WeightSubscriber",
    "WeightsConfig",
    "build_publisher",
    "build_subscriber",
]


def __getattr__(name: str) -> Any:
    if name in _HOME:
        return getattr(importlib.import_module(f"asyncrl.weights.{_HOME[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
