"""The trainer role's choice of backend: the one place that names weight-publisher classes. The
builder matches on the `weights` member's `type` (the union is `asyncrl.config.WeightsConfig`);
the chosen member's module loads only on its branch."""

from __future__ import annotations

from typing import TYPE_CHECKING, assert_never

from asyncrl.sglang.config import SglangWeightsConfig
from asyncrl.weights.config import BroadcastWeightsConfig, StoreWeightsConfig

if TYPE_CHECKING:
    from collections.abc import Callable

    import redis
    import torch

    from asyncrl.config import WeightsConfig
    from asyncrl.model_config import LoraConfig
    from asyncrl.runstate import Keys
    from asyncrl.weights.base import SyncRecord, WeightPublisher


def build_publisher(
    cfg: WeightsConfig,
    client: redis.Redis,
    keys: Keys,
    *,
    device: torch.device | str,
    on_record: Callable[[SyncRecord], None] | None = None,
    lora: LoraConfig | None = None,
) -> WeightPublisher:
    """`lora` (`model.lora`) matters to SGLang servers only, which load adapters by name; the
    other transports carry whatever tensors they are given."""
    import torch

    match cfg:
        case BroadcastWeightsConfig():
            from asyncrl.weights.broadcast import BroadcastPublisher

            return BroadcastPublisher(cfg, client, keys, torch.device(device), on_record)
        case StoreWeightsConfig():
            from asyncrl.weights.store import StorePublisher

            return StorePublisher(cfg, client, keys, torch.device(device), on_record)
        case SglangWeightsConfig():
            from asyncrl.sglang.publisher import SglangPublisher

            return SglangPublisher(cfg, client, keys, torch.device(device), on_record, lora)
        case _:
            assert_never(cfg)
