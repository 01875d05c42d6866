"""Mixture-of-experts routing: what the engine records and what the trainer replays (R3).

Token-level importance ratios of an MoE model swing when the trainer routes a token to other
experts than the rollout engine did (bf16 against fp32, a batched decode against one full
forward). Rollout Routing Replay records each fed token's top-k experts per MoE layer at rollout
and has the trainer's forward use them: the gate weights are recomputed from the trainer's own
router logits over the recorded experts, with the family's own top-k weighting (softmax over
all experts, then the chosen ones, renormalised where the family renormalises), so gradients
still reach the router.

One seam: `FAMILIES`, keyed by `config.model_type`. Qwen3-MoE, Qwen2-MoE and Mixtral share one
router shape in transformers 5 (a `gate` module returning `(logits, weights, indices)` over the
flattened tokens), so capture and replay are forward hooks on those modules, and a family is one
row: the router's class name and how it weights its top-k.

Row order: a router sees the block's tokens flattened row-major, so its row b × S + s is batch
row b, column s; the routers are taken in module order, which is layer order.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(frozen=True)
class RouterFamily:
    router: str
    """Class name of the family's top-k router module."""
    renormalise: Callable[[Any], bool]
    """Whether the top-k weights are renormalised to sum to 1 (given the router module)."""
    weights_in_logits_dtype: bool
    """Whether the weights are cast back to the router logits' dtype (Qwen) or stay float32."""


FAMILIES: dict[str, RouterFamily] = {
    "qwen3_moe": RouterFamily("Qwen3MoeTopKRouter", lambda r: bool(r.norm_topk_prob), True),
    "qwen2_moe": RouterFamily("Qwen2MoeTopKRouter", lambda r: bool(r.norm_topk_prob), True),
    "mixtral": RouterFamily("MixtralTopKRouter", lambda r: True, False),
}


@dataclass(frozen=True)
class MoeShape:
    """What a routing record of this model looks like."""

    layers: int
    """MoE layers (dense layers of a partly sparse model have no router)."""
    top_k: int
    num_experts: int


def family_of(model: torch.nn.Module) -> RouterFamily | None:
    config = getattr(model, "config", None)
    return FAMILIES.get(getattr(config, "model_type", ""))


def routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's top-k routers in layer order; empty for a dense model or an unknown family."""
    family = family_of(model)
    if family is None:
        return []
    return [m for m in model.modules() if type(m).__name__ == family.router]


def moe_shape(model: torch.nn.Module) -> MoeShape | None:
    found: list[Any] = routers(model)
    if not found:
        return None
    return MoeShape(len(found), int(found[0].top_k), int(found[0].num_experts))


def moe_shape_of_config(config: Any) -> MoeShape | None:
    """The shape from a Hugging Face config alone (no weights): for readers' limits and for
    reshaping an SGLang server's flat routing reply."""
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    kind = getattr(config, "model_type", "")
    if kind not in FAMILIES:
        return None
    experts: int = getattr(config, "num_experts", None) or config.num_local_experts
    layers = int(config.num_hidden_layers)
    if kind != "mixtral":  # the Qwen MoE families can leave some layers dense
        dense = set(getattr(config, "mlp_only_layers", None) or ())
        step = int(getattr(config, "decoder_sparse_step", 1) or 1)
        layers = sum(1 for i in range(layers) if i not in dense and (i + 1) % step == 0)
    return MoeShape(layers, int(config.num_experts_per_tok), int(experts))


@dataclass
class Routing:
    """One forward's routing, per router (layer order): the experts the model used, each
    [tokens, k], and the ones its router picked itself (they differ only under replay)."""

    used: list[torch.Tensor] = field(default_factory=list)
    own: list[torch.Tensor] = field(default_factory=list)

    def stacked(self, rows: int, *, own: bool = False) -> torch.Tensor:
        """The used experts (or with `own` the router's picks) as [rows, columns, layers, k]."""
        per_layer = torch.stack(self.own if own else self.used, dim=1)  # [tokens, layers, k]
        return per_layer.reshape(rows, -1, *per_layer.shape[1:])


@contextmanager
def routing_hooks(
    model: torch.nn.Module,
    replay: torch.Tensor | None = None,
    replay_mask: torch.Tensor | None = None,
) -> Iterator[Routing]:
    """Record the routing of the forward passes inside the block (cleared by each pass's first
    router), and with `replay` ([B, S, layers, k] expert ids) and `replay_mask` ([B, S] bool,
    where to use them) make those tokens use the recorded experts instead of their own top-k."""
    found = routers(model)
    family = family_of(model)
    if not found or family is None:
        raise ValueError("routing needs a mixture-of-experts model of " + ", ".join(FAMILIES))
    record = Routing()
    handles = []
    for layer, router in enumerate(found):

        def hook(
            module: torch.nn.Module, args: Any, output: Any, layer: int = layer
        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            logits, weights, own = output
            if layer == 0:
                record.used.clear()
                record.own.clear()
            used = own
            if replay is not None and replay_mask is not None:
                chosen = replay[:, :, layer].reshape(-1, own.shape[-1]).to(own)
                used = torch.where(replay_mask.reshape(-1, 1), chosen, own)
                weights = _weights(module, family, logits, used)
            record.used.append(used.detach())
            record.own.append(own.detach())
            return logits, weights, used

        handles.append(router.register_forward_hook(hook))
    try:
        yield record
    finally:
        for h in handles:
            h.remove()


def _weights(
    router: torch.nn.Module, family: RouterFamily, logits: torch.Tensor, chosen: torch.Tensor
) -> torch.Tensor:
    """The family's top-k weights of `chosen` experts from the router logits, as its own
    forward computes them for the experts it picks."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights = probs.gather(-1, chosen)
    if family.renormalise(router):
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype) if family.weights_in_logits_dtype else weights
