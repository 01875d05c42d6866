"""The trainer role: read groups, bound staleness, step, publish weights, checkpoint, then ack.

Order of durability (DESIGN §9): a step's trajectory entries stay pending on this rank's consumer
(`trainer-{rank}`) until a checkpoint that includes the step is on disk; only then are they acked
and counted as trained. A trainer killed between checkpoints restarts from the last one, re-reads
its pending entries first and trains on them again, so each trajectory shapes the surviving model
exactly once. Restored weights are published under a new version, never a reused one.

With several ranks, every decision that leads into a collective is taken together: ranks agree
after each read whether all have their share, whether one was told to stop (SIGTERM) or waited in
vain, so a signal to any one rank stops them all at the same point, none left alone in a
collective. A checkpoint records every rank's trained-but-unacked entry ids (gathered to rank 0),
and a restarted rank 0 acks those the previous trainer did not, on behalf of all ranks.
"""

from __future__ import annotations

import contextlib
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
from asyncrl.provenance import trajectory_groups
from asyncrl.queue import Stopped
from asyncrl.redis_conn import connect
from asyncrl.rollout.config import SglangEngineConfig
from asyncrl.trainer.admission import Admission, Cursor, load_cursor
from asyncrl.trainer.batch import group_rows
from asyncrl.trainer.checkpoint import (
    TrainerState,
    list_checkpoints,
    load_checkpoint,
    record_version,
    recorded_version,
    save_checkpoint,
)
from asyncrl.trainer.parallel import full_parameters, full_state, shard
from asyncrl.trainer.prefetch import Prefetcher
from asyncrl.trainer.step import train_step, weights_finite

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
    """The trainer group's backend: the device's, and gloo for the small CPU tensors of the
    bookkeeping collectives (normalisers, stop flags, entry ids) that NCCL / HCCL cannot carry."""
    from asyncrl.device import backend_of

    if device.type == "cpu":
        return "gloo"
    return f"cpu:gloo,{device.type}:{backend_of(device.type)}"


def consumer_name(rank: int) -> str:
    """The stable trajectory consumer of a trainer rank (DESIGN §3)."""
    return f"trainer-{rank}"


class Trainer:
    def __init__(self, cfg: Config) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from asyncrl.heartbeat import Heartbeat, is_alive
        from asyncrl.metrics.jsonl import JsonlWriter
        from asyncrl.metrics.poller import RunGauges
        from asyncrl.metrics.roles import RoleMetrics
        from asyncrl.metrics.server import serve
        from asyncrl.model import ensure_model, vocab_size
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
        # One rank has nothing to shard.
        self.sharded = cfg.trainer.parallel == "fsdp" and self.world_size > 1
        self.max_staleness = 0 if cfg.run.mode == "sync" else cfg.algo.max_staleness
        self.stopping = False
        self.client = connect(cfg.redis)
        self.name = consumer_name(self.rank)
        self.metrics = RoleMetrics("trainer", self.name)
        # The trainer's own Redis calls wait out outages like the queue's do, until SIGTERM.
        self.redis = RedisGuard(
            reconnect_max_s=cfg.redis.reconnect_max_s,
            should_stop=lambda: self.stopping,
            on_outage=self.metrics.redis_outage,
        )

        model_dir = ensure_model(cfg)
        self.tokenizer_dir = model_dir
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        ckpts = list_checkpoints(self.run_dir / "checkpoints") if cfg.trainer.resume else []
        load_from = ckpts[-1] if ckpts else model_dir
        torch.manual_seed(cfg.trainer.seed)
        dtype = getattr(torch, cfg.trainer.dtype)
        self.model = AutoModelForCausalLM.from_pretrained(load_from, dtype=dtype)
        self.n_params = sum(p.numel() for p in self.model.parameters())
        if cfg.trainer.gradient_checkpointing:
            self.model.gradient_checkpointing_enable()
        self._place(self.model)
        self.ref_model = None
        if cfg.algo.kl_coef > 0:
            self.ref_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
            self.ref_model.eval().requires_grad_(False)
            self._place(self.ref_model)
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(),
            lr=cfg.trainer.lr,
            betas=cfg.trainer.betas,
            weight_decay=cfg.trainer.weight_decay,
        )
        self.task = build_task(cfg.task, self.tokenizer)
        self.covered_at_restart: dict[str, list[str]] = {}
        self.step = 0
        self.wall_offset = 0.0
        cursor = Cursor(seed=cfg.run.seed)
        resumed_version = -1
        resumed_counters: dict[str, int] = {}
        if ckpts:
            state = load_checkpoint(ckpts[-1], self.model, self.optimizer)
            self.step, self.wall_offset = state.step, state.wall_seconds
            self.covered_at_restart = state.covered if self.rank == 0 else {}
            cursor = Cursor(**state.cursor)
            resumed_version = state.version
            resumed_counters = state.counters
            log.info("resumed from %s (step %d)", ckpts[-1].name, self.step)
        published = self.redis.call(
            lambda: self.client.get(self.keys.version), "read the published version"
        )
        # Never reuse a version number: restored (or initial) weights get a fresh one, above the
        # checkpoint's and the run directory's record too, since a Redis that lost its data has
        # no `version` key.
        known = -1 if published is None else int(published)
        if cfg.trainer.resume:
            known = max(known, resumed_version, recorded_version(self.run_dir / "checkpoints"))
        self.version = known + 1
        if self.world is not None:
            # Rank 0's reading wins: it may already have published before another rank reads.
            shared = torch.tensor([self.version], dtype=torch.int64, device=self.device)
            dist.broadcast(shared, src=0, group=self.world)
            self.version = int(shared.item())

        self.limits = Limits(
            max_message_bytes=cfg.queue.max_message_bytes, vocab_size=vocab_size(load_from)
        )
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
            groups=trajectory_groups(self.keys),
            reconnect_max_s=cfg.redis.reconnect_max_s,
            should_stop=lambda: self.stopping,
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
                counters=resumed_counters,
                held=self.consumer.held_groups,
                max_message_bytes=cfg.queue.max_message_bytes,
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
        self.released_for = (self.step, self.version)
        """Step and version prompts are released for: set once the step's weights are published
        (sync mode's prompts must not precede them) and its groups acked (the bound counts
        unacked ones as not yet trained)."""
        self.prefetch = Prefetcher(self.consumer, before_read=self._release, settle=self._settle)
        self.unacked: list[str] = []
        self.evaluator: Any = None
        self.last_sync_seconds: float | None = None
        self.t0 = time.monotonic()

    # -- helpers -------------------------------------------------------------------------------

    def _place(self, module: torch.nn.Module) -> None:
        """Move `module` to the device: whole, or as FSDP shards."""
        if self.sharded:
            shard(module, self.device, self.world_size)
        else:
            module.to(self.device)

    def _any(self, *flags: bool) -> list[bool]:
        """Each flag OR-ed over the ranks (one small all-reduce)."""
        if self.world is None:
            return list(flags)
        t = torch.tensor(flags, dtype=torch.int32)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.world)
        return [bool(v) for v in t.tolist()]

    def _gather_ids(self, ids: list[str]) -> dict[str, list[str]]:
        """Every rank's entry ids by consumer name, complete on rank 0. They travel as JSON in
        byte tensors padded to the longest: nothing is pickled."""
        if self.world is None:
            return {self.name: list(ids)}
        data = torch.frombuffer(bytearray(json.dumps(ids).encode()), dtype=torch.uint8)
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world_size)]
        dist.all_gather(sizes, torch.tensor([data.numel()]), group=self.world)
        longest = max(int(n) for n in sizes)
        padded = torch.zeros(longest, dtype=torch.uint8)
        padded[: data.numel()] = data
        gathered = [torch.empty(longest, dtype=torch.uint8) for _ in range(self.world_size)]
        dist.all_gather(gathered, padded, group=self.world)
        return {
            consumer_name(r): json.loads(t[: int(n)].numpy().tobytes())
            for r, (t, n) in enumerate(zip(gathered, sizes, strict=True))
        }

    def _ack_covered(self) -> None:
        """Rank 0 at restart: ack the entries trained into the checkpoint we resumed from whose
        ack did not happen before the previous trainer died. Rank 0 first takes each list over
        from its consumer (XCLAIM moves only ids still pending; those already acked are neither
        acked nor counted again), so it also serves ranks that no longer exist."""
        for consumer, ids in self.covered_at_restart.items():
            if ids:
                self._take_over(ids)
                settled = self._settle(ids, "groups_trained")
                if settled:
                    log.info("acked %d entries of %s trained before the restart", settled, consumer)

    def _take_over(self, ids: list[str]) -> None:
        """Make those of `ids` still pending pending on this rank's consumer."""
        from redis import exceptions as rx

        def claim() -> None:
            stream, group = self.keys.trajectories, TRAJECTORIES_GROUP
            try:
                self.client.xclaim(stream, group, self.name, 0, list(ids), justid=True)
            except rx.ResponseError as exc:
                if "NOGROUP" not in str(exc):  # no group: Redis lost the entries with it
                    raise

        self.redis.call(claim, "take over trained entries")

    def _read_ahead(self) -> int:
        """Deliveries to read ahead of the current step: two steps' worth, so that groups which
        turn stale while buffered are replaced from the buffer rather than by a read once the
        step has begun; none for steps that will not run (they would stay pending); none with
        several ranks (see `trainer/prefetch.py`)."""
        if self.world is not None:
            return 0
        return min(2, self.cfg.trainer.max_steps - self.step - 1) * self.local_groups

    def _release(self) -> None:
        """Rank 0: release the prompts the budget allows now (after each step, and at every read
        of the prefetch thread: budget freed by stale drops)."""
        if self.stopping or self.admission is None:
            return
        release = partial(self.admission.release, *self.released_for)
        # SIGTERM while Redis is unreachable ends the wait: a stopping trainer needs no prompts.
        with contextlib.suppress(Stopped):
            self.redis.call(release, "release prompts")

    def _settle(self, ids: list[str], outcome: str) -> int:
        """`Consumer.settle`; on rank 0 through admission, which looks for a loss of Redis's data
        first (so that the entries held are kept in flight through it, not found gone) and
        counts what was settled in the counters it remembers."""
        if self.admission is None:
            return self.consumer.settle(ids, outcome)
        settle = partial(
            self.admission.settle, partial(self.consumer.settle, ids, outcome), outcome
        )
        return self.redis.call(settle, f"settle entries as {outcome}")

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
        """Hand the current weights to rank 0's publisher; returns the seconds it blocked. A
        sharded model's full tensors are gathered first, with every rank taking part."""
        start = time.perf_counter()
        params = full_parameters(self.model) if self.sharded else self.model
        if self.rank != 0:
            return 0.0
        gathered = time.perf_counter() - start
        record_version(self.run_dir / "checkpoints", self.version)
        blocking = gathered + self.publisher.publish(params, self.version)
        self.redis.call(
            lambda: self.client.set(self.keys.version, self.version), "publish the version"
        )
        self.metrics.policy_version.set(self.version)
        return blocking

    # -- reading -------------------------------------------------------------------------------

    def _collect(self) -> tuple[list[TrajectoryGroup], list[int], list[str]] | None:
        """This rank's share of usable groups for the next step, their staleness and entry ids;
        None when the trainer is to stop.

        After every read (at most `redis.block_ms`) the ranks agree whether all have their share,
        whether one was told to stop, or whether one got nothing for `trainer.wait_timeout_s`; so
        a SIGTERM on any one rank stops all within a read, each leaving from here, and the step's
        collectives run on all ranks or on none. A rank with its share reads no further but keeps
        agreeing (and rank 0 releasing prompts: stale drops elsewhere free budget).

        The ids join `self.unacked` only once the step has run: a stop while collecting leaves
        the groups collected so far pending (re-read after a restart), not acked as trained at
        the final checkpoint.
        """
        groups: list[TrajectoryGroup] = []
        staleness: list[int] = []
        ids: list[str] = []
        waited_since = time.monotonic()
        while True:
            if not self.stopping and len(groups) < self.local_groups:
                with self.metrics.time_phase("queue_wait"):
                    deliveries = self.prefetch.take(
                        self.local_groups - len(groups), self.cfg.redis.block_ms / 1000
                    )
                if deliveries:
                    waited_since = time.monotonic()
                stale = []
                for d in deliveries:
                    g: TrajectoryGroup = d.value
                    lag = self.version - g.min_version
                    if lag > self.max_staleness:
                        stale.append(d.id)
                        continue
                    groups.append(g)
                    staleness.append(lag)
                    ids.append(d.id)
                if stale:
                    # Not waited for: the reading thread applies it before its next read.
                    self.prefetch.settle(stale, "groups_dropped_stale", wait=False)
                    self.metrics.trajectories_dropped["stale"].inc(len(stale))
            short = len(groups) < self.local_groups
            starved = short and time.monotonic() - waited_since > self.cfg.trainer.wait_timeout_s
            short, stop, starved = self._any(short, self.stopping, starved)
            if stop:
                return None
            if starved:
                raise SystemExit(
                    "no trajectory for trainer.wait_timeout_s="
                    f"{self.cfg.trainer.wait_timeout_s} seconds: are rollout workers running?"
                )
            if not short:
                return groups, staleness, ids

    # -- the loop ------------------------------------------------------------------------------

    def run(self) -> int:
        signal.signal(signal.SIGTERM, self._on_sigterm)
        self.heartbeat.start()
        if self.rank == 0:
            self._ack_covered()
        if self.world is not None:
            dist.barrier(self.world)  # no rank reads its pending entries before those acks
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
                waited_from = time.monotonic()
                # Released only now, after the last step's acks, as the bound counts them; here
                # rather than on the reading thread, which may be in a read for 50 ms.
                self.released_for = (self.step, self.version)
                self._release()
                self.prefetch.set_read_ahead(self._read_ahead())
                collected = self._collect()
                if collected is None:
                    break
                groups, staleness, ids = collected
                self._train(groups, staleness, time.monotonic() - waited_from)
                self.unacked.extend(ids)
                if self.step % self.cfg.trainer.checkpoint_every == 0:
                    self._checkpoint()
                if self.cfg.trainer.eval_every and self.step % self.cfg.trainer.eval_every == 0:
                    self._evaluate()
            if self.unacked or self.step % self.cfg.trainer.checkpoint_every:
                self._checkpoint()
        except Stopped as exc:
            # What was not acked stays pending; what a checkpoint covers is acked at restart.
            log.warning("trainer %s: stopped while waiting for Redis (%s)", self.name, exc)
        finally:
            # Stopping already: a later SIGTERM must not kill the exit (Python restores the
            # default disposition of handled signals while it finalises).
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            self.prefetch.close()
            self.heartbeat.stop()
            if self.publisher is not None:
                self.publisher.close()
                self.run_gauges.stop()
        return 0

    def _on_sigterm(self, *_: object) -> None:
        self.stopping = True

    def _train(
        self, groups: list[TrajectoryGroup], staleness: list[int], wait_seconds: float
    ) -> None:
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
        if stats.skipped:
            log.warning("step %d: loss or grad norm not finite, update skipped", self.step + 1)
        if not weights_finite(self.model, self.world):
            # Rollout workers must never get them, and no later step can repair them.
            raise SystemExit(
                f"step {self.step + 1} made the weights non-finite (lr {lr:g}): not publishing "
                "them; restart from the last checkpoint with a lower trainer.lr"
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
            "skipped_nonfinite": stats.skipped,
            "step_seconds": step_seconds,
            # Collecting this step's groups: idle time when the rollouts are the bottleneck.
            "wait_seconds": wait_seconds,
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
        # Only `asyncrl status` reads it: SIGTERM in an outage skips it, the step is complete.
        with contextlib.suppress(Stopped):
            self.redis.call(
                lambda: self.client.set(self.keys.last_step, json.dumps(line)), "write last_step"
            )

    def _checkpoint(self) -> None:
        """Collective: every rank contributes its entry ids and (sharded) state; rank 0 writes."""
        with self.metrics.time_phase("checkpoint"):
            covered = self._gather_ids(self.unacked)
            model_state, optimizer_state = full_state(self.model, self.optimizer)
            if self.rank == 0:
                assert self.admission is not None
                state = TrainerState(
                    step=self.step,
                    version=self.version,
                    cursor=self.admission.cursor_dict(),
                    wall_seconds=self.wall_seconds(),
                    covered=covered,
                    counters=self.admission.counters(),
                )
                save_checkpoint(
                    self.run_dir / "checkpoints",
                    self.model,
                    model_state,
                    optimizer_state,
                    state,
                    tokenizer_dir=self.tokenizer_dir,
                    keep=self.cfg.trainer.keep_checkpoints,
                )
            if self.world is not None:
                dist.barrier(self.world)
            # The checkpoint holding these steps is durable: now they count as trained.
            if self.unacked:
                self.prefetch.settle(self.unacked, "groups_trained")
                self.unacked = []

    def _evaluate(self) -> None:
        if self.rank != 0:
            return
        from asyncrl.trainer.evaluate import Evaluator

        if self.evaluator is None:
            self.evaluator = Evaluator(self.model, self.tokenizer, self.task, self.cfg)
        with self.metrics.time_phase("eval"):
            acc = self.evaluator.reward()
        if acc is None:
            log.warning("step %d eval: no held-out item could be scored", self.step)
            return
        line = {
            "step": self.step,
            "wall_seconds": round(self.wall_seconds(), 3),
            "eval_accuracy": acc,
        }
        self.metrics.eval_accuracy.set(acc)
        if self.jsonl is not None:
            self.jsonl.write(line)
        log.info("step %d eval accuracy %.3f", self.step, acc)


def run_trainer(cfg: Config) -> int:
    return Trainer(cfg).run()
