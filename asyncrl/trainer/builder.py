"""Builds what a trainer rank needs, one small function per piece, into one typed record.

Order matters where a piece reads another's result: the process group first (the version
broadcast and FSDP need it), the checks that the checkpoint may be resumed with this config, the
run's trainer lease (`asyncrl.lease`, before anything of the run is touched, and renewed by the
heartbeat from then on), then the model (placed whole or as shards), the optimizer, the
resume (optimizer and RNG state of the last checkpoint), the version to publish first, and
last the Redis side — consumer, ledger and, on rank 0 only, admission, the weight publisher and
the metrics outputs.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from asyncrl.device import resolve_device, return_freed_memory
from asyncrl.engines.routing import moe_shape
from asyncrl.protocol import Limits, TrajectoryGroup, ValidationError, decode_groups
from asyncrl.runstate import TRAJECTORIES_GROUP
from asyncrl.runtime import RoleRuntime, open_runtime
from asyncrl.trainer.admission import Admission, Cursor, load_cursor
from asyncrl.trainer.checkpoint import (
    list_checkpoints,
    load_checkpoint,
    recorded_version,
    resume_refusal,
)
from asyncrl.trainer.ledger import Ledger, consumer_name
from asyncrl.trainer.parallel import Ranks, shard

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from asyncrl.config import Config
    from asyncrl.heartbeat import Heartbeat
    from asyncrl.lease import Lease
    from asyncrl.metrics.poller import RunGauges
    from asyncrl.queue import Consumer
    from asyncrl.tasks.base import Task
    from asyncrl.trainer.outputs import StepOutputs
    from asyncrl.weights.base import SyncRecord, WeightPublisher

log = logging.getLogger("asyncrl.trainer")


@dataclass
class LoopState:
    """What the loop changes and the built pieces read back (heartbeat, decoding, the
    weight-sync hook): one mutable object shared by reference."""

    step: int
    version: int
    """The version of the weights in hand: published, or about to be."""
    last_sync_seconds: float | None = None
    """Duration of the publisher's last delivery (set on its thread); None before the first."""


@dataclass(frozen=True)
class Resumed:
    """What the checkpoint resumed from holds; the defaults of a fresh run without one."""

    checkpoint: Path | None = None
    step: int = 0
    wall_seconds: float = 0.0
    version: int = -1
    cursor: Cursor | None = None
    counters: dict[str, int] = field(default_factory=dict)
    covered: dict[str, list[str]] = field(default_factory=dict)
    """Entry ids by consumer that the checkpoint covers (see `ledger`)."""
    groups_consumed: int | None = None
    """The groups its steps consumed; None: step × trainer.groups_per_step."""


@dataclass(frozen=True)
class RankZero:
    """What only rank 0 runs."""

    admission: Admission
    publisher: WeightPublisher
    run_gauges: RunGauges
    outputs: StepOutputs


@dataclass(frozen=True)
class TrainerParts:
    cfg: Config
    runtime: RoleRuntime
    device: torch.device
    ranks: Ranks
    state: LoopState
    model_dir: Path
    """The base model (tokenizer, reference model, saved with each checkpoint)."""
    tokenizer: PreTrainedTokenizerBase
    model: PreTrainedModel
    ref_model: PreTrainedModel | None
    """The frozen reference policy of the KL term; None with algo.kl_coef = 0. With
    `model.lora` it is `model` itself, run with the adapter disabled."""
    optimizer: torch.optim.Optimizer
    n_params: int
    task: Task
    resumed: Resumed
    local_groups: int
    """This rank's share of trainer.groups_per_step."""
    sharded: bool
    heartbeat: Heartbeat
    lease: Lease | None
    """Rank 0's hold on the run (renewed by its heartbeat); None on the other ranks."""
    consumer: Consumer[TrajectoryGroup]
    ledger: Ledger
    rank0: RankZero | None


def dist_backend(device: torch.device) -> str:
    """The trainer group's backend: the device's, and gloo for the small CPU tensors of the
    bookkeeping collectives (normalisers, stop flags, entry ids) that NCCL / HCCL cannot carry."""
    from asyncrl.device import backend_of

    if device.type == "cpu":
        return "gloo"
    return f"cpu:gloo,{device.type}:{backend_of(device.type)}"


def build_ranks(cfg: Config, device: torch.device) -> Ranks:
    size = int(os.environ.get("WORLD_SIZE", 1))
    world = None
    if size > 1:
        dist.init_process_group(dist_backend(device))
        world = dist.group.WORLD
    if cfg.trainer.groups_per_step % size:
        raise SystemExit(
            f"trainer.groups_per_step={cfg.trainer.groups_per_step} must be a multiple of "
            f"the number of trainer ranks ({size})"
        )
    return Ranks(int(os.environ.get("RANK", 0)), size, world)


def place(module: torch.nn.Module, device: torch.device, ranks: Ranks, sharded: bool) -> None:
    """Move `module` to the device: whole, or as FSDP shards."""
    if sharded:
        shard(module, device, ranks.size)
    else:
        module.to(device)


def build_models(
    cfg: Config, load_from: Path, model_dir: Path, place_: Callable[[torch.nn.Module], None]
) -> tuple[PreTrainedModel, PreTrainedModel | None, int]:
    """The trained model (from the last checkpoint, if any), the KL reference (the base) and
    the trained model's parameter count (before sharding). With `model.lora` the base is loaded
    from `model_dir` and the adapter from the checkpoint; the reference is the model itself,
    run with its adapter disabled (`lora.adapter_disabled`)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(cfg.trainer.seed)
    dtype = getattr(torch, cfg.trainer.dtype)
    lora_cfg = cfg.model.lora
    from asyncrl.lora import is_adapter_dir

    if load_from != model_dir and is_adapter_dir(load_from) != (lora_cfg is not None):
        # A run cannot switch between a LoRA and a full fine-tune across a restart.
        held = "a LoRA adapter" if is_adapter_dir(load_from) else "a full model"
        raise SystemExit(
            f"checkpoint {load_from} holds {held}, but model.lora is "
            f"{'unset' if lora_cfg is None else 'set'}: resume with the run's own model.lora"
        )
    model = AutoModelForCausalLM.from_pretrained(
        load_from if lora_cfg is None else model_dir, dtype=dtype
    )
    n_params = sum(p.numel() for p in model.parameters())
    if lora_cfg is not None:
        from asyncrl.lora import wrap

        if cfg.trainer.gradient_checkpointing:
            # The frozen embedding's output needs grad, or checkpointed blocks get none.
            model.enable_input_require_grads()
        model = wrap(model, lora_cfg, None if load_from == model_dir else load_from)
    if cfg.trainer.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    place_(model)
    if lora_cfg is not None:
        return model, model if cfg.algo.kl_coef > 0 else None, n_params
    ref_model = None
    if cfg.algo.kl_coef > 0:
        ref_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
        ref_model.eval().requires_grad_(False)
        place_(ref_model)
    return model, ref_model, n_params


def build_optimizer(cfg: Config, model: torch.nn.Module) -> torch.optim.Optimizer:
    # Frozen parameters (a LoRA run's base) get no optimizer state.
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW(
        params,
        lr=cfg.trainer.lr,
        betas=cfg.trainer.betas,
        weight_decay=cfg.trainer.weight_decay,
        **adamw_kernel(params),
    )


# Devices whose fused AdamW asyncrl has checked against the for-loop one (tests/
# test_trainer_step.py, DDP and FSDP2 on CPU; CUDA's is the kernel most trainers run).
_FUSED_ADAMW = frozenset({"cpu", "cuda"})


def adamw_kernel(params: Sequence[torch.Tensor]) -> dict[str, bool]:
    """AdamW's implementation flags: fused on the devices in `_FUSED_ADAMW`. The fused kernel
    updates a parameter in one pass with no temporaries, where the for-loop one (torch's default
    on CPU) allocates two the size of the parameter: at 150 M parameters, two copies of the
    tied embedding on top of parameters + gradients + Adam state, the trainer's peak. Elsewhere
    (NPU) torch's default."""
    if params and all(p.device.type in _FUSED_ADAMW for p in params):
        return {"fused": True}
    return {}


def resume(
    checkpoint: Path | None, model: torch.nn.Module, optimizer: torch.optim.Optimizer, rank: int
) -> Resumed:
    """Optimizer and RNG state from `checkpoint` (the model was loaded from it) and its run
    state; only rank 0 acks what it covers."""
    if checkpoint is None:
        return Resumed()
    state = load_checkpoint(checkpoint, model, optimizer)
    log.info("resumed from %s (step %d)", checkpoint.name, state.step)
    return Resumed(
        checkpoint=checkpoint,
        step=state.step,
        wall_seconds=state.wall_seconds,
        version=state.version,
        cursor=Cursor(**state.cursor),
        counters=state.counters,
        covered=state.covered if rank == 0 else {},
        groups_consumed=state.groups_consumed,
    )


def first_version(rt: RoleRuntime, resumed: Resumed, ranks: Ranks, device: torch.device) -> int:
    """The version the restored (or initial) weights are published under: never a reused one,
    so above the published one, the checkpoint's and the run directory's record too, since a
    Redis that lost its data has no `version` key."""
    cfg = rt.cfg
    published = rt.redis.call(lambda: rt.client.get(rt.keys.version), "read the published version")
    known = -1 if published is None else int(published)
    if cfg.trainer.resume:
        known = max(known, resumed.version, recorded_version(cfg.run.path / "checkpoints"))
    version = known + 1
    if ranks.world is not None:
        # Rank 0's reading wins: it may already have published before another rank reads.
        shared = torch.tensor([version], dtype=torch.int64, device=device)
        dist.broadcast(shared, src=0, group=ranks.world)
        version = int(shared.item())
    return version


def decoder(
    limits: Limits, state: LoopState
) -> Callable[[list[bytes]], list[TrajectoryGroup | ValidationError]]:
    """The consumer's decode: a read's trajectory entries at once, validated against the version
    in hand."""

    def decode(datas: list[bytes]) -> list[TrajectoryGroup | ValidationError]:
        return [
            ValidationError("malformed", "empty prompt: the first token has no logits")
            if type(g) is TrajectoryGroup and not len(g.prompt_ids)
            else g
            for g in decode_groups(datas, limits, current_version=state.version)
        ]

    return decode


def build_admission(
    rt: RoleRuntime, task: Task, resumed: Resumed, consumer: Consumer[TrajectoryGroup]
) -> Admission:
    cfg, client, keys = rt.cfg, rt.client, rt.keys
    cursor = resumed.cursor or Cursor(seed=cfg.run.seed)
    g = cfg.trainer.groups_per_step
    consumed = resumed.step * g if resumed.groups_consumed is None else resumed.groups_consumed
    return Admission(
        client,
        keys,
        task,
        task_name=cfg.task.type,
        n=cfg.rollout.n,
        max_staleness=rt.max_staleness,
        groups_per_step=cfg.trainer.groups_per_step,
        cursor=rt.redis.call(lambda: load_cursor(client, keys, cursor), "read the data cursor"),
        consumed_before=consumed - resumed.step * g,
        counters=resumed.counters,
        held=consumer.held_groups,
        queue=cfg.queue,
        guard=rt.redis,
    )


def build_rank_zero(
    rt: RoleRuntime, device: torch.device, admission: Admission, state: LoopState
) -> RankZero:
    """The weight publisher and the metrics outputs of rank 0."""
    from asyncrl.metrics.jsonl import JsonlWriter
    from asyncrl.metrics.poller import RunGauges
    from asyncrl.metrics.record import MISMATCH_LOG
    from asyncrl.metrics.trackers import RunInfo, TrackerFeed
    from asyncrl.trainer.backends import build_publisher
    from asyncrl.trainer.outputs import StepOutputs

    cfg, client, keys, metrics = rt.cfg, rt.client, rt.keys, rt.metrics

    def on_sync(record: SyncRecord) -> None:
        """Called on the publisher's thread after each delivery."""
        state.last_sync_seconds = record.sync_s
        metrics.weight_sync_seconds.observe(record.sync_s)
        metrics.weight_sync_bytes.inc(record.bytes_sent)
        if record.delta:
            metrics.weight_sync_deltas.inc()

    publisher = build_publisher(
        cfg.weights, client, keys, device=device, on_record=on_sync, lora=cfg.model.lora
    )
    jsonl = JsonlWriter(cfg.run.path / "metrics.jsonl") if cfg.metrics.jsonl else None
    mismatch_log = JsonlWriter(cfg.run.path / MISMATCH_LOG) if cfg.metrics.jsonl else None
    run = RunInfo(cfg.run.id, cfg.run.path, cfg.redacted())
    trackers = TrackerFeed(cfg.metrics.trackers, run) if cfg.metrics.trackers else None
    metrics.staleness_bound.set(rt.max_staleness)
    run_gauges = RunGauges(metrics, client, keys).start()
    return RankZero(
        admission, publisher, run_gauges, StepOutputs(rt, jsonl, mismatch_log, trackers)
    )


def check_resumable(cfg: Config, checkpoint: Path | None, model_dir: Path) -> None:
    """Refuse (`ConfigError`, exit 2) a resume the checkpoint does not fit (`resume_refusal`)."""
    from asyncrl.config import ConfigError

    if checkpoint is not None:
        refusal = resume_refusal(checkpoint, model_dir, cfg.task.model_dump(mode="json"))
        if refusal is not None:
            raise ConfigError(refusal)


def hold_run(rt: RoleRuntime, ranks: Ranks, state: LoopState) -> tuple[Heartbeat, Lease | None]:
    """Rank 0 takes the run's trainer lease, or every rank leaves (`LeaseHeld`); then each rank's
    heartbeat beats, rank 0's renewing the lease. A lease found taken later stops the trainer."""
    from asyncrl.lease import Lease, LeaseHeld

    def stop() -> None:
        rt.stop.stopping = True

    lease = None
    refused: LeaseHeld | None = None
    if ranks.rank == 0:
        ttl = rt.cfg.rollout.heartbeat_ttl_s
        lease = Lease(rt.client, rt.keys.trainer_lease, ttl, on_lost=stop)
        try:
            rt.redis.call(lease.acquire, "take the run's trainer lease")
        except LeaseHeld as exc:
            refused = exc
    if ranks.any(refused is not None)[0]:
        raise refused or LeaseHeld("another trainer holds this run (rank 0 was refused it)")
    heartbeat = rt.heartbeat(lambda: {"version": state.version, "step": state.step}, lease=lease)
    return heartbeat.start(), lease


def build(cfg: Config) -> TrainerParts:
    from asyncrl.model import max_positions
    from asyncrl.model_identity import model_identity, publish_identity
    from asyncrl.provenance import trajectory_groups

    device = resolve_device(cfg.trainer.device)
    return_freed_memory()
    ranks = build_ranks(cfg, device)
    # One rank has nothing to shard.
    sharded = cfg.trainer.parallel == "fsdp" and ranks.size > 1
    state = LoopState(step=0, version=0)
    rt = open_runtime(cfg, "trainer", consumer_name(ranks.rank), serves_metrics=ranks.rank == 0)

    model_dir = rt.model_dir()
    ckpts = list_checkpoints(cfg.run.path / "checkpoints") if cfg.trainer.resume else []
    checkpoint = ckpts[-1] if ckpts else None
    check_resumable(cfg, checkpoint, model_dir)
    heartbeat, lease = hold_run(rt, ranks, state)
    if ranks.rank == 0:  # before any prompt is released: workers check theirs against it
        identity = model_identity(model_dir, cfg.model.lora)
        rt.redis.call(
            lambda: publish_identity(rt.client, rt.keys, identity), "publish the model identity"
        )
    tokenizer = rt.tokenizer(model_dir)
    load_from = checkpoint or model_dir
    model, ref_model, n_params = build_models(
        cfg, load_from, model_dir, partial(place, device=device, ranks=ranks, sharded=sharded)
    )
    optimizer = build_optimizer(cfg, model)
    task = rt.task(tokenizer)
    resumed = resume(checkpoint, model, optimizer, ranks.rank)
    state.step = resumed.step
    state.version = first_version(rt, resumed, ranks, device)

    moe = moe_shape(model)
    limits = replace(
        rt.limits(model_dir),
        max_positions=max_positions(model_dir),
        num_experts=None if moe is None else moe.num_experts,
        moe_layers=None if moe is None else moe.layers,
        moe_top_k=None if moe is None else moe.top_k,
    )
    consumer = rt.consumer(
        rt.keys.trajectories,
        TRAJECTORIES_GROUP,
        trajectory_groups(rt.keys),
        decode_batch=decoder(limits, state),
    )
    admission = None
    rank0 = None
    if ranks.rank == 0:
        admission = build_admission(rt, task, resumed, consumer)
        rank0 = build_rank_zero(rt, device, admission, state)
    ledger = Ledger(
        consumer,
        ranks,
        rt.redis,
        rt.client,
        admission=admission,
        lease=lease,
        covered_at_restart=resumed.covered,
    )
    return TrainerParts(
        cfg=cfg,
        runtime=rt,
        device=device,
        ranks=ranks,
        state=state,
        model_dir=model_dir,
        tokenizer=tokenizer,
        model=model,
        ref_model=ref_model,
        optimizer=optimizer,
        n_params=n_params,
        task=task,
        resumed=resumed,
        local_groups=cfg.trainer.groups_per_step // ranks.size,
        sharded=sharded,
        heartbeat=heartbeat,
        lease=lease,
        consumer=consumer,
        ledger=ledger,
        rank0=rank0,
    )
