"""Weight sync between trainer rank 0 and the rollout workers (DESIGN §7).

Importing the package loads no torch, so configs validate without it; the builders and Protocols
are loaded on first use:

    from asyncrl.weights import WeightsConfig, build_publisher, build_subscriber
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from asyncrl.weights.config import WeightsConfig

if TYPE_CHECKING:
    from asyncrl.weights.base import (
        PublisherStats,
        SyncRecord,
        WeightPublisher,
        WeightSubscriber,
        build_publisher,
        build_subscriber,
    )

__all__ = [
    "PublisherStats",
    "SyncRecord",
    "WeightPublisher",
    "WeightSubscriber",
    "WeightsConfig",
    "build_publisher",
    "build_subscriber",
]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from asyncrl.weights import base

        return getattr(base, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
