"""The trainer role: read groups, bound staleness, step, publish weights, checkpoint, then ack.

Order of durability (DESIGN §9): a step's trajectory entries stay pending on this rank's consumer
(`trainer-{rank}`) until a checkpoint that includes the step is on disk; only then are they acked
and counted as trained. A trainer killed between checkpoints restarts from the last one, re-reads
its pending entries first and trains on them again, so each trajectory shapes the surviving model
exactly once. Restored weights are published under a new version, never a reused one.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import time
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from asyncrl.config import Config
from asyncrl.keys import TRAJECTORIES_GROUP, Keys
from asyncrl.protocol import Limits, TrajectoryGroup, ValidationError, decode_group
from asyncrl.redis_conn import connect
from asyncrl.rollout.config import SglangEngineConfig
from asyncrl.trainer.admission import Admission, Cursor, load_cursor
from asyncrl.trainer.batch import group_rows
from asyncrl.trainer.checkpoint import (
    TrainerState,
    list_checkpoints,
    load_checkpoint,
    save_checkpoint,
)
from asyncrl.trainer.step import train_step

log = logging.getLogger("asyncrl.trainer")


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        name = "cpu"
    if name == "cuda":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    if name == "npu":
        import torch_npu  # noqa: F401  # registers the npu device

        return torch.device("npu", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def dist_backend(device: torch.device) -> str:
    return {"cuda": "nccl", "npu": "hccl"}.get(device.type, "gloo")


class Trainer:
    def __init__(self, cfg: Config) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from asyncrl.heartbeat import Heartbeat, is_alive
        from asyncrl.metrics import JsonlWriter, RoleMetrics, RunGauges, serve
        from asyncrl.model import ensure_model
        from asyncrl.queue import Consumer, RedisGuard
        from asyncrl.rollout.tasks import build_task

        self.cfg = cfg
        self.run_dir = cfg.run.path
        self.keys = Keys(cfg.run.id)
        self.device = resolve_device(cfg.trainer.device)
        self.rank = int(os.environ.get("RANK", 0))
        self.world_size = int(os.environ.get("WORLD_SIZE", 1))
        self.world: dist.ProcessGroup | None = None
        if self.world_size > 1:
            dist.init_process_group(dist_backend(self.device))
            self.world = dist.group.WORLD
        if cfg.trainer.groups_per_step % self.world_size:
            raise SystemExit(
                f"trainer.groups_per_step={cfg.trainer.groups_per_step} must be a multiple of "
                f"the number of trainer ranks ({self.world_size})"
            )
        self.local_groups = cfg.trainer.groups_per_step // self.world_size
        self.max_staleness = 0 if cfg.run.mode == "sync" else cfg.algo.max_staleness
        self.stopping = False
        self.client = connect(cfg.redis)
        self.name = f"trainer-{self.rank}"
        self.metrics = RoleMetrics("trainer", self.name)
        # The trainer's own Redis calls wait out outages like the queue's do.
        self.redis = RedisGuard(
            reconnect_max_s=cfg.redis.reconnect_max_s, on_outage=self.metrics.redis_outage
        )

        model_dir = ensure_model(cfg)
        self.tokenizer_dir = model_dir
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        ckpts = list_checkpoints(self.run_dir / "checkpoints") if cfg.trainer.resume else []
        load_from = ckpts[-1] if ckpts else model_dir
        torch.manual_seed(cfg.trainer.seed)
        dtype = getattr(torch, cfg.trainer.dtype)
        self.model = AutoModelForCausalLM.from_pretrained(load_from, dtype=dtype)
        self.model.to(self.device)  # type: ignore[arg-type]
        self.n_params = sum(p.numel() for p in self.model.parameters())
        if cfg.trainer.gradient_checkpointing:
            self.model.gradient_checkpointing_enable()
        self.ref_model = None
        if cfg.algo.kl_coef > 0:
            self.ref_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
            self.ref_model.to(self.device)  # type: ignore[arg-type]
            self.ref_model.eval().requires_grad_(False)
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(),
            lr=cfg.trainer.lr,
            betas=cfg.trainer.betas,
            weight_decay=cfg.trainer.weight_decay,
        )
        self.task = build_task(cfg.task, self.tokenizer)
        self.covered_at_restart: list[str] = []
        self.step = 0
        self.wall_offset = 0.0
        cursor = Cursor(seed=cfg.run.seed)
        if ckpts:
            state = load_checkpoint(ckpts[-1], self.optimizer)
            self.step, self.wall_offset = state.step, state.wall_seconds
            self.covered_at_restart = state.covered if self.rank == 0 else []
            cursor = Cursor(**state.cursor)
            log.info("resumed from %s (step %d)", ckpts[-1].name, self.step)
        published = self.redis.call(
            lambda: self.client.get(self.keys.version), "read the published version"
        )
        # Never reuse a version number: restored (or initial) weights get a fresh one.
        self.version = 0 if published is None else int(published) + 1
        if self.world is not None:
            # Rank 0's reading wins: it may already have published before another rank reads.
            shared = torch.tensor([self.version], dtype=torch.int64, device=self.device)
            dist.broadcast(shared, src=0, group=self.world)
            self.version = int(shared.item())

        self.limits = Limits(max_message_bytes=cfg.queue.max_message_bytes)
        self.heartbeat = Heartbeat(
            self.client,
            self.keys.worker("trainer", self.name),
            cfg.rollout.heartbeat_ttl_s,
            lambda: {"version": self.version, "step": self.step},
        )
        self.consumer = Consumer(
            self.client,
            self.keys.trajectories,
            TRAJECTORIES_GROUP,
            self.name,
            cfg.queue,
            dlq=self.keys.dlq,
            counters_key=self.keys.counters,
            is_alive=is_alive(self.client, self.keys, "trainer"),
            decode=self._decode,
            reconnect_max_s=cfg.redis.reconnect_max_s,
            on_outage=self.metrics.redis_outage,
        )
        self.admission: Admission | None = None
        self.publisher: Any = None
        self.jsonl: Any = None
        if self.rank == 0:
            self.admission = Admission(
                self.client,
                self.keys,
                self.task,
                task_name=cfg.task.type,
                n=cfg.rollout.n,
                max_staleness=self.max_staleness,
                groups_per_step=cfg.trainer.groups_per_step,
                cursor=self.redis.call(
                    lambda: load_cursor(self.client, self.keys, cursor), "read the data cursor"
                ),
            )
            from asyncrl.weights import build_publisher

            if isinstance(cfg.rollout.engine, SglangEngineConfig):
                from asyncrl.weights.sglang import SglangPublisher

                self.publisher = SglangPublisher(
                    cfg.weights,
                    cfg.rollout.engine,
                    self.client,
                    self.keys,
                    self.device,
                    on_record=self._on_sync,
                )
            else:
                self.publisher = build_publisher(
                    cfg.weights, self.client, self.keys, device=self.device, on_record=self._on_sync
                )
            if cfg.metrics.jsonl:
                self.jsonl = JsonlWriter(self.run_dir / "metrics.jsonl")
            if cfg.metrics.port:
                serve(cfg.metrics.host, cfg.metrics.port, self._health)
            self.metrics.staleness_bound.set(self.max_staleness)
            self.run_gauges = RunGauges(self.metrics, self.client, self.keys).start()
        self.unacked: list[str] = []
        self.evaluator: Any = None
        self.last_sync_seconds: float | None = None
        self.t0 = time.monotonic()

    # -- helpers -------------------------------------------------------------------------------

    def _decode(self, fields: dict[bytes, bytes]) -> TrajectoryGroup:
        data = fields.get(b"data")
        if data is None:
            raise ValidationError("malformed", "entry has no data field")
        group = decode_group(data, self.limits, current_version=self.version)
        if len(group.prompt_ids) == 0:
            raise ValidationError("malformed", "empty prompt: the first token has no logits")
        return group

    def _health(self) -> tuple[bool, str]:
        try:
            self.client.ping()
        except Exception as exc:  # any failure to reach Redis means not ready
            return False, f"redis: {type(exc).__name__}"
        return True, "ok"

    def _on_sync(self, record: Any) -> None:
        """Called on the publisher's thread after each delivery."""
        self.last_sync_seconds = record.sync_s
        self.metrics.weight_sync_seconds.observe(record.sync_s)
        self.metrics.weight_sync_bytes.inc(record.bytes_sent)

    def wall_seconds(self) -> float:
        return self.wall_offset + time.monotonic() - self.t0

    def _publish(self) -> float:
        """Hand the current weights to the publisher; returns the blocking seconds."""
        blocking = 0.0
        if self.rank == 0:
            blocking = self.publisher.publish(self.model, self.version)
            self.redis.call(
                lambda: self.client.set(self.keys.version, self.version), "publish the version"
            )
            self.metrics.policy_version.set(self.version)
        return blocking

    # -- reading -------------------------------------------------------------------------------

    def _collect(self) -> tuple[list[TrajectoryGroup], list[int], list[str]]:
        """This rank's share of usable groups for the next step, their staleness and entry ids.

        The ids join `self.unacked` only once the step has run: a SIGTERM while collecting must
        leave the groups collected so far pending (re-read after a restart), not ack them as
        trained at the final checkpoint.
        """
        groups: list[TrajectoryGroup] = []
        staleness: list[int] = []
        ids: list[str] = []
        waited_since = time.monotonic()
        while len(groups) < self.local_groups:
            if self.stopping:
                raise _Stop
            if self.admission is not None:
                release = partial(self.admission.release, self.step, self.version)
                self.redis.call(release, "release prompts")
            with self.metrics.time_phase("queue_wait"):
                deliveries = self.consumer.read(
                    self.local_groups - len(groups), self.cfg.redis.block_ms
                )
            if not deliveries:
                if time.monotonic() - waited_since > self.cfg.trainer.wait_timeout_s:
                    raise SystemExit(
                        "no trajectory for trainer.wait_timeout_s="
                        f"{self.cfg.trainer.wait_timeout_s} seconds: are rollout workers running?"
                    )
                continue
            waited_since = time.monotonic()
            for d in deliveries:
                g: TrajectoryGroup = d.value
                lag = self.version - g.min_version
                if lag > self.max_staleness:
                    self.consumer.ack([d.id], counters={"groups_dropped_stale": 1})
                    self.metrics.trajectories_dropped["stale"].inc()
                    continue
                groups.append(g)
                staleness.append(lag)
                ids.append(d.id)
        return groups, staleness, ids

    # -- the loop ------------------------------------------------------------------------------

    def run(self) -> int:
        signal.signal(signal.SIGTERM, self._on_sigterm)
        self.heartbeat.start()
        if self.covered_at_restart:
            # Trained into the checkpoint we resumed from, but the ack did not happen before the
            # previous trainer died: ack them now (a no-op for ids no longer pending).
            self.consumer.ack(
                self.covered_at_restart, counters={"groups_trained": len(self.covered_at_restart)}
            )
        self._publish()
        log.info(
            "trainer %s: step %d, version %d, %d rank(s), mode %s",
            self.name,
            self.step,
            self.version,
            self.world_size,
            self.cfg.run.mode,
        )
        try:
            while self.step < self.cfg.trainer.max_steps:
                try:
                    groups, staleness, ids = self._collect()
                except _Stop:
                    break
                self._train(groups, staleness)
                self.unacked.extend(ids)
                if self.step % self.cfg.trainer.checkpoint_every == 0:
                    self._checkpoint()
                if self.cfg.trainer.eval_every and self.step % self.cfg.trainer.eval_every == 0:
                    self._evaluate()
            if self.unacked or self.step % self.cfg.trainer.checkpoint_every:
                self._checkpoint()
        finally:
            self.heartbeat.stop()
            if self.publisher is not None:
                self.publisher.close()
                self.run_gauges.stop()
        return 0

    def _on_sigterm(self, *_: object) -> None:
        self.stopping = True

    def _train(self, groups: list[TrajectoryGroup], staleness: list[int]) -> None:
        t_start = time.monotonic()
        sampling = self.cfg.rollout.sampling
        rows = group_rows(groups, self.cfg.algo, sampling.max_new_tokens)
        lr = self.cfg.trainer.lr_at(self.step)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        with self.metrics.time_phase("train"):
            stats = train_step(
                self.model,
                self.optimizer,
                rows,
                algo=self.cfg.algo,
                sampling=sampling,
                micro_batch_tokens=self.cfg.trainer.micro_batch_tokens,
                grad_clip=self.cfg.trainer.grad_clip,
                current_version=self.version,
                ref_model=self.ref_model,
                world=self.world,
                device=self.device,
            )
        self.step += 1
        self.version += 1
        blocking = self._publish()
        step_seconds = time.monotonic() - t_start
        if self.rank != 0:
            return
        rewards = [s.reward for g in groups for s in g.samples]
        line = {
            "step": self.step,
            "version": self.version,
            "wall_seconds": round(self.wall_seconds(), 3),
            "groups": len(groups) * self.world_size,
            "tokens": stats.tokens,
            "reward_mean": sum(rewards) / max(len(rewards), 1),
            "staleness_mean": sum(staleness) / max(len(staleness), 1),
            "staleness_max": max(staleness, default=0),
            "behaviour_weight_mean": stats.behaviour_weight_mean,
            "behaviour_weight_capped_fraction": stats.behaviour_weight_capped_fraction,
            "clip_fraction": stats.clip_fraction,
            "behaviour_logprob_abs_diff_lag0": stats.logprob_abs_diff_lag0,
            "lag0_tokens": stats.lag0_tokens,
            "loss": stats.loss,
            "grad_norm": stats.grad_norm,
            "lr": lr,
            "step_seconds": step_seconds,
            "weight_publish_blocking_seconds": blocking,
            "weight_sync_seconds": self.last_sync_seconds,
            **stats.weight_quantiles,
        }
        peak = self.cfg.trainer.peak_flops
        if peak:
            flops = 6.0 * self.n_params * stats.processed_tokens
            line["mfu"] = flops / max(step_seconds, 1e-9) / (peak * self.world_size)
        self.metrics.observe_step(line, staleness)
        if self.jsonl is not None:
            self.jsonl.write(line)
        self.redis.call(
            lambda: self.client.set(self.keys.last_step, json.dumps(line)), "write last_step"
        )

    def _checkpoint(self) -> None:
        with self.metrics.time_phase("checkpoint"):
            if self.rank == 0:
                assert self.admission is not None
                state = TrainerState(
                    step=self.step,
                    version=self.version,
                    cursor=self.admission.cursor.as_dict(),
                    wall_seconds=self.wall_seconds(),
                    covered=list(self.unacked),
                )
                save_checkpoint(
                    self.run_dir / "checkpoints",
                    self.model,
                    self.optimizer,
                    state,
                    tokenizer_dir=self.tokenizer_dir,
                    keep=self.cfg.trainer.keep_checkpoints,
                )
            if self.world is not None:
                dist.barrier(self.world)
            # The checkpoint holding these steps is durable: now they count as trained.
            if self.unacked:
                self.consumer.ack(self.unacked, counters={"groups_trained": len(self.unacked)})
                self.unacked = []

    def _evaluate(self) -> None:
        if self.rank != 0:
            return
        from asyncrl.trainer.evaluate import Evaluator

        if self.evaluator is None:
            self.evaluator = Evaluator(self.model, self.tokenizer, self.task, self.cfg)
        with self.metrics.time_phase("eval"):
            acc = self.evaluator.accuracy()
        line = {
            "step": self.step,
            "wall_seconds": round(self.wall_seconds(), 3),
            "eval_accuracy": acc,
        }
        self.metrics.eval_accuracy.set(acc)
        if self.jsonl is not None:
            self.jsonl.write(line)
        log.info("step %d eval accuracy %.3f", self.step, acc)


class _Stop(Exception):
    """SIGTERM arrived while waiting for data: checkpoint what was trained and leave."""


def run_trainer(cfg: Config) -> int:
    return Trainer(cfg).run()
