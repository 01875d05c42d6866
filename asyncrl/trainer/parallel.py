"""How the trained model is laid out over the trainer ranks (`trainer.parallel`).

- `ddp`: every rank holds the whole model and optimizer; `train_step` sums the gradients over
  ranks with one all-reduce.
- `fsdp`: FSDP2 (`fully_shard`) on every decoder layer and on the root, for models that do not fit
  one device: parameters, gradients and optimizer state are sharded over the ranks, and FSDP
  reduce-scatters the gradients. They are summed, not averaged (divide factor 1), because the loss
  already uses global normalisers — as in `ddp`, N ranks make the update of one.

Whatever the layout, checkpoints and published weights hold full tensors, in one format, so a run
may change its layout or rank count across a restart. Gathering full tensors from shards is a
collective: every rank calls `full_parameters` / `full_state`, rank 0 gets the tensors (on the
CPU) and the other ranks empty results (an unsharded model's: its own, which they ignore).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Ranks:
    """This process' place among the trainer ranks. With one rank `world` is None and every
    collective below is a no-op."""

    rank: int
    size: int
    world: dist.ProcessGroup | None

    def any(self, *flags: bool) -> list[bool]:
        """Each flag OR-ed over the ranks (one small all-reduce)."""
        if self.world is None:
            return list(flags)
        t = torch.tensor(flags, dtype=torch.int32)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.world)
        return [bool(v) for v in t.tolist()]

    def barrier(self) -> None:
        if self.world is not None:
            dist.barrier(self.world)


def shard(module: torch.nn.Module, device: torch.device, world_size: int) -> None:
    """FSDP2-wrap `module` in place: each block Hugging Face keeps whole (`_no_split_modules`,
    the decoder layers), then the root. Shards move to `device`."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, fully_shard

    mesh = init_device_mesh(device.type, (world_size,))
    blocks = set(getattr(module, "_no_split_modules", None) or ())
    for sub in list(module.modules()):
        if type(sub).__name__ in blocks:
            fully_shard(sub, mesh=mesh)
    fully_shard(module, mesh=mesh)
    for sub in module.modules():
        if isinstance(sub, FSDPModule):
            sub.set_gradient_divide_factor(1.0)
            # A plain SUM: a custom factor otherwise means PREMUL_SUM, which gloo (and hccl)
            # lack.
            sub.set_force_sum_reduction_for_comms(True)


def is_sharded(module: torch.nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(module, FSDPModule)


def global_value(t: torch.Tensor) -> float:
    """A scalar that may be a DTensor (e.g. the grad norm of sharded gradients)."""
    from torch.distributed.tensor import DTensor

    return float(t.full_tensor() if isinstance(t, DTensor) else t)


def full_parameters(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """(name, full tensor) in `named_parameters()` order of the parameters that train (a LoRA
    model's adapter), for the weight publisher. Collective."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=True)
    state = cast(dict[str, torch.Tensor], get_model_state_dict(model, options=options))
    if not state:
        return []
    # The state dict also lists tied aliases: publish what `named_parameters()` would.
    return [(name, state[name]) for name, p in model.named_parameters() if p.requires_grad]


def full_state(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Full model and optimizer state dicts (optimizer state keyed by parameter name) for a
    checkpoint, of the parameters that train (a LoRA model's adapter). Collective.

    An unsharded model's are its own tensors (moved to the CPU), in the distributed helper's
    format: that helper gathers nothing here, and its walk over every parameter's names took
    13-67 ms of a 50 M-parameter checkpoint."""
    names = {n for n, _ in model.named_parameters()}
    # Gathered copies no longer share storage, so the checkpoint would store tied aliases
    # (lm_head beside the embedding) twice: keep what loading expects.
    aliases = {n for n, _ in model.named_parameters(remove_duplicate=False)} - names
    if not is_sharded(model):
        frozen = {n for n, p in model.named_parameters() if not p.requires_grad} | aliases
        model_state = {k: v.cpu() for k, v in model.state_dict().items() if k not in frozen}
        by_id = {id(p): n for n, p in model.named_parameters()}
        order = [by_id[id(p)] for g in optimizer.param_groups for p in g["params"]]
        held = optimizer.state_dict()
        state = {order[i]: {k: _cpu(v) for k, v in s.items()} for i, s in held["state"].items()}
        groups = [{**g, "params": [order[i] for i in g["params"]]} for g in held["param_groups"]]
        return model_state, {"state": state, "param_groups": groups}

    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=True)
    model_state, optimizer_state = get_state_dict(model, optimizer, options=options)
    return {k: v for k, v in model_state.items() if k not in aliases}, optimizer_state


def _cpu(value: Any) -> Any:
    return value.cpu() if isinstance(value, torch.Tensor) else value


def load_optimizer_state(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]
) -> None:
    """Restore a `full_state` optimizer dict; each rank keeps its own shard of it.

    An unsharded model's goes to `optimizer.load_state_dict`, names turned into indices: the
    distributed loader first takes an optimizer step on zero gradients to create the state it
    then overwrites, most of a resume (50 M parameters: 5.3 s of 7.9 s)."""
    # A loaded param group brings the flags of the optimizer that saved it; the kernel stays this
    # optimizer's (a checkpoint of before the fused AdamW resumes fused), with the step counts
    # where the fused kernel wants them.
    kernels: list[dict[str, Any]] = [
        {k: g[k] for k in ("fused", "foreach") if k in g} for g in optimizer.param_groups
    ]
    _load_optimizer_state(model, optimizer, state)
    for group, kernel in zip(optimizer.param_groups, kernels, strict=True):
        group.update(kernel)
        for p in group["params"] if kernel.get("fused") else ():
            step = optimizer.state.get(p, {}).get("step")
            if isinstance(step, torch.Tensor):
                optimizer.state[p]["step"] = step.to(p.device, torch.float32)


def _load_optimizer_state(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]
) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    if not is_sharded(model):
        names = {id(p): n for n, p in model.named_parameters()}
        order = [names[id(p)] for g in optimizer.param_groups for p in g["params"]]
        index = {name: i for i, name in enumerate(order)}
        if {n for g in state["param_groups"] for n in g["params"]} == set(index):
            groups = [
                {**g, "params": [index[n] for n in g["params"]]} for g in state["param_groups"]
            ]
            by_index = {index[name]: s for name, s in state["state"].items()}
            optimizer.load_state_dict({"state": by_index, "param_groups": groups})
            return

    set_optimizer_state_dict(
        model, optimizer, optim_state_dict=state, options=StateDictOptions(full_state_dict=True)
    )
