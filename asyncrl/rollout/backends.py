"""The rollout role's choice of backend: the one place that names engine and weight-subscriber
classes. Each builder matches on its config member's `type` (the unions are assembled with the
config tree: `rollout.config.EngineConfig`, `asyncrl.config.WeightsConfig`); the chosen member's
module, and its heavy imports, load only on its branch. A new engine is one more case here and
one union member, and no edit in a seam (`engines/`, `weights/`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, assert_never

from asyncrl.engines.config import TorchEngineConfig
from asyncrl.sglang.config import SglangEngineConfig, SglangWeightsConfig
from asyncrl.weights.config import BroadcastWeightsConfig, StoreWeightsConfig

if TYPE_CHECKING:
    import redis
    import torch

    from asyncrl.config import WeightsConfig
    from asyncrl.engines.base import RolloutEngine
    from asyncrl.model_config import LoraConfig
    from asyncrl.rollout.config import EngineConfig
    from asyncrl.runstate import Keys
    from asyncrl.weights.base import OnWeights, WeightSubscriber


def build_engine(
    cfg: EngineConfig,
    *,
    model_path: str,
    lora: LoraConfig | None = None,
    capture_routing: bool = False,
) -> RolloutEngine:
    """The engine `cfg.type` names, serving the Hugging Face model in the local directory
    `model_path` on the device its config names, serving the adapter of `lora` (`model.lora`),
    recording each token's experts with `capture_routing` (an MoE model)."""
    match cfg:
        case TorchEngineConfig():
            from asyncrl.engines.torch_engine import TorchEngine

            return TorchEngine.from_config(
                cfg, model_path=model_path, lora=lora, capture_routing=capture_routing
            )
        case SglangEngineConfig():
            from asyncrl.sglang.engine import SglangEngine

            return SglangEngine.from_config(
                cfg, model_path=model_path, lora=lora, capture_routing=capture_routing
            )
        case _:
            assert_never(cfg)


def build_subscriber(
    cfg: WeightsConfig,
    client: redis.Redis,
    keys: Keys,
    worker_id: str,
    *,
    device: torch.device | str,
    on_weights: OnWeights,
    engine: RolloutEngine | None = None,
    keeps_dtype: torch.dtype | None = None,
) -> WeightSubscriber:
    """`on_weights` receives the tensors of in-process transports; `engine` is the worker's
    engine, which the SGLang member asks for its servers' URLs (it receives no tensors).
    `keeps_dtype` (`kept_dtype(engine)`): the broadcast publisher may send floating tensors in
    it; the store's files keep the trainer's dtypes (their readers are not known)."""
    import torch

    match cfg:
        case BroadcastWeightsConfig():
            from asyncrl.weights.broadcast import BroadcastSubscriber

            return BroadcastSubscriber(
                cfg, client, keys, worker_id, torch.device(device), on_weights, keeps_dtype
            )
        case StoreWeightsConfig():
            from asyncrl.weights.store import StoreSubscriber

            return StoreSubscriber(cfg, client, keys, worker_id, torch.device(device), on_weights)
        case SglangWeightsConfig():
            from asyncrl.sglang.publisher import SglangSubscriber

            return SglangSubscriber.for_engine(cfg, client, keys, worker_id, engine)
        case _:
            assert_never(cfg)


def kept_dtype(engine: RolloutEngine | None) -> torch.dtype | None:
    """The one floating dtype an in-process engine keeps its synced weights in; None for an
    engine that keeps several, or that is not in process."""
    from asyncrl.engines.base import InProcessWeights

    if not isinstance(engine, InProcessWeights):
        return None
    dtypes = {t.dtype for t in engine.state_dict_for_sync().values() if t.is_floating_point()}
    return dtypes.pop() if len(dtypes) == 1 else None
