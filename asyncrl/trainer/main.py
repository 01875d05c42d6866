"""The trainer role: read groups, bound staleness, step, publish weights, checkpoint, then ack.

`builder` makes the pieces, `ledger` keeps the order of durability (entries acked only once a
checkpoint holding their step is on disk); this module is the loop. Restored weights are
published under a new version, never a reused one.

With several ranks, every decision that leads into a collective is taken together: ranks agree
after each read whether all have their share, whether one was told to stop (SIGTERM) or waited in
vain, so a signal to any one rank stops them all at the same point, none left alone in a
collective.

One trainer holds a run (`asyncrl.lease`): rank 0 checks its lease before it publishes or writes
a checkpoint (and the ledger before it acks), and a lease found taken stops every rank at the
next agreement, with one line.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import time
from functools import partial
from typing import TYPE_CHECKING, Any

from asyncrl.algo.mismatch import audit_table
from asyncrl.lease import LeaseLost
from asyncrl.lora import synced
from asyncrl.metrics.breakdown import TRAINER_PHASES, Breakdown, phase
from asyncrl.metrics.record import EvalRecord, StepRecord
from asyncrl.profiling import StepProfiler
from asyncrl.protocol import TrajectoryGroup
from asyncrl.redis_conn import Stopped
from asyncrl.runstate import Counter
from asyncrl.trainer.batch import group_rows
from asyncrl.trainer.builder import RankZero, build
from asyncrl.trainer.checkpoint import TrainerState, record_version, save_checkpoint
from asyncrl.trainer.length_bias import LengthBias, lag_masked_fraction
from asyncrl.trainer.parallel import full_parameters, full_state
from asyncrl.trainer.prefetch import Prefetcher
from asyncrl.trainer.step import StepStats, train_step, weights_finite

if TYPE_CHECKING:
    import redis

    from asyncrl.config import Config
    from asyncrl.evaluate import Evaluator
    from asyncrl.runstate import Keys
    from asyncrl.weights.base import WeightPublisher

log = logging.getLogger("asyncrl.trainer")


class Trainer:
    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.parts = build(cfg)
        self.ranks = self.parts.ranks
        self.state = self.parts.state
        self.stop = self.parts.runtime.stop
        self.ledger = self.parts.ledger
        self.metrics = self.parts.runtime.metrics
        self.released_for = (self.step, self.version)
        """Step and version prompts are released for: set once the step's weights are published
        (sync mode's prompts must not precede them) and its groups acked (the bound counts
        unacked ones as not yet trained)."""
        self.prefetch = Prefetcher(
            self.parts.consumer, before_read=self._release, settle=self.ledger.settle
        )
        self.evaluator: Evaluator | None = None
        self.length_bias = LengthBias()
        self.dropped: list[TrajectoryGroup] = []
        """Groups dropped stale while the next step collected (`stale_policy: drop`)."""
        self.t0 = time.monotonic()
        self._copy_wait = 0.0
        self.breakdown = Breakdown(TRAINER_PHASES)
        self.profiler = StepProfiler(cfg.profile, "trainer", self.parts.consumer.name, cfg.run.path)
        if self.rank0 is not None:
            # Weights are published with a deferred copy: the optimizer changes them only once
            # the publisher has copied them (it does so while forward and backward run).
            self.parts.optimizer.register_step_pre_hook(self._before_optimizer_step)

    # -- what callers and tests read -----------------------------------------------------------

    @property
    def step(self) -> int:
        return self.state.step

    @property
    def version(self) -> int:
        return self.state.version

    @version.setter
    def version(self, value: int) -> None:
        self.state.version = value

    @property
    def client(self) -> redis.Redis:
        return self.parts.runtime.client

    @property
    def keys(self) -> Keys:
        return self.parts.runtime.keys

    @property
    def rank0(self) -> RankZero | None:
        return self.parts.rank0

    @property
    def publisher(self) -> WeightPublisher | None:
        return None if self.rank0 is None else self.rank0.publisher

    def wall_seconds(self) -> float:
        return self.parts.resumed.wall_seconds + time.monotonic() - self.t0

    # -- the loop ------------------------------------------------------------------------------

    def run(self) -> int:
        signal.signal(signal.SIGTERM, self.stop.on_sigterm)
        self.breakdown.activate()
        if self.rank0 is not None:
            self.ledger.ack_covered_at_restart()
        self.ranks.barrier()  # no rank reads its pending entries before those acks
        self._publish()
        log.info(
            "trainer %s: step %d, version %d, %d rank(s), mode %s",
            self.parts.consumer.name,
            self.step,
            self.version,
            self.ranks.size,
            self.cfg.run.mode,
        )
        every = self.cfg.trainer.checkpoint_every
        try:
            while self.step < self.cfg.trainer.max_steps:
                waited_from = time.monotonic()
                # Released only now, after the last step's acks, as the bound counts them; here
                # rather than on the reading thread, which may be in a read for 50 ms.
                self.released_for = (self.step, self.version)
                self._release()
                self.prefetch.set_read_ahead(self._read_ahead())
                with phase("wait"):
                    collected = self._collect()
                if collected is None:
                    break
                groups, staleness, ids = collected
                with self.profiler.step(self.step + 1):
                    self._train(groups, staleness, time.monotonic() - waited_from)
                self.ledger.record(ids)
                if self.step % every == 0:
                    self._checkpoint()
                if self.cfg.trainer.eval_every and self.step % self.cfg.trainer.eval_every == 0:
                    self._evaluate()
            if self.ledger.unacked or self.step % every:
                self._checkpoint()
        except Stopped as exc:
            # What was not acked stays pending; what a checkpoint covers is acked at restart.
            log.warning(
                "trainer %s: stopped while waiting for Redis (%s)", self.parts.consumer.name, exc
            )
        finally:
            # Stopping already: a later SIGTERM must not kill the exit (Python restores the
            # default disposition of handled signals while it finalises).
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            self.close()
        return 0

    def close(self) -> None:
        """Stop the threads, give the run's lease back and close the outputs (`run` does at its
        end; a caller that built a trainer without running it does)."""
        self.prefetch.close()
        self.parts.heartbeat.stop()
        if self.rank0 is not None:
            self.rank0.publisher.close()
            self.rank0.run_gauges.stop()
            self.rank0.outputs.close()
        self.client.close()

    # -- reading -------------------------------------------------------------------------------

    def _read_ahead(self) -> int:
        """Deliveries to read ahead of the current step: two steps' worth, so that groups which
        turn stale while buffered are replaced from the buffer rather than by a read once the
        step has begun; none for steps that will not run (they would stay pending); none with
        several ranks (see `trainer/prefetch.py`)."""
        if self.ranks.world is not None:
            return 0
        return min(2, self.cfg.trainer.max_steps - self.step - 1) * self.parts.local_groups

    def _release(self) -> None:
        """Rank 0: release the prompts the budget allows now (after each step, and at every read
        of the prefetch thread: budget freed by stale drops)."""
        if self.stop.stopping or self.rank0 is None:
            return
        release = partial(self.rank0.admission.release, *self.released_for)
        # SIGTERM while Redis is unreachable ends the wait: a stopping trainer needs no prompts.
        with contextlib.suppress(Stopped):
            self.parts.runtime.redis.call(release, "release prompts")

    def _collect(self) -> tuple[list[TrajectoryGroup], list[int], list[str]] | None:
        """This rank's share of usable groups for the next step, their staleness and entry ids;
        None when the trainer is to stop.

        After every read (at most `redis.block_ms`) the ranks agree whether all have their share,
        whether one was told to stop, or whether one got nothing for `trainer.wait_timeout_s`; so
        a SIGTERM on any one rank stops all within a read, each leaving from here, and the step's
        collectives run on all ranks or on none. A rank with its share reads no further but keeps
        agreeing (and rank 0 releasing prompts: stale drops elsewhere free budget).

        The ids join the ledger only once the step has run: a stop while collecting leaves the
        groups collected so far pending (re-read after a restart), not acked as trained at the
        final checkpoint.
        """
        want = self.parts.local_groups
        groups: list[TrajectoryGroup] = []
        staleness: list[int] = []
        ids: list[str] = []
        waited_since = time.monotonic()
        while True:
            if not self.stop.stopping and len(groups) < want:
                with self.metrics.time_phase("queue_wait"):
                    deliveries = self.prefetch.take(
                        want - len(groups), self.cfg.redis.block_ms / 1000
                    )
                if deliveries:
                    waited_since = time.monotonic()
                stale = []
                for d in deliveries:
                    g: TrajectoryGroup = d.value
                    lag = self.version - g.min_version
                    if self.dropping and lag > self.parts.runtime.max_staleness:
                        stale.append(d.id)
                        self.dropped.append(g)
                        continue
                    groups.append(g)
                    staleness.append(lag)
                    ids.append(d.id)
                if stale:
                    # Not waited for: the reading thread applies it before its next read.
                    self.prefetch.settle(stale, Counter.GROUPS_DROPPED_STALE, wait=False)
                    self.metrics.trajectories_dropped["stale"].inc(len(stale))
            short = len(groups) < want
            starved = short and time.monotonic() - waited_since > self.cfg.trainer.wait_timeout_s
            lost = self.parts.lease is not None and self.parts.lease.lost
            short, stop, starved, lost = self.ranks.any(short, self.stop.stopping, starved, lost)
            if lost:
                # Nothing of this trainer's goes out any more: no final checkpoint, no acks.
                raise LeaseLost(
                    "another trainer took this run: stopped before publishing or acking "
                    "anything more"
                )
            if stop:
                return None
            if starved:
                raise SystemExit(
                    "no trajectory for trainer.wait_timeout_s="
                    f"{self.cfg.trainer.wait_timeout_s} seconds: are rollout workers running?"
                )
            if not short:
                return groups, staleness, ids

    @property
    def dropping(self) -> bool:
        """Whether groups staler than η are dropped (`algo.stale_policy: drop`) rather than
        trained with their old tokens corrected or masked."""
        return self.cfg.algo.stale_policy == "drop"

    # -- stepping, publishing, checkpointing ---------------------------------------------------

    def _train(
        self, groups: list[TrajectoryGroup], staleness: list[int], wait_seconds: float
    ) -> None:
        t_start = time.monotonic()
        parts = self.parts
        sampling = self.cfg.rollout.sampling
        token_lag = (self.version, self.cfg.algo.token_lag_limit(self.parts.runtime.max_staleness))
        with phase("collate"):
            rows = group_rows(groups, self.cfg.algo, sampling.max_new_tokens, token_lag=token_lag)
        lr = self.cfg.trainer.lr_at(self.step)
        for group in parts.optimizer.param_groups:
            group["lr"] = lr
        with self.metrics.time_phase("train"):
            stats = train_step(
                parts.model,
                parts.optimizer,
                rows,
                algo=self.cfg.algo,
                sampling=sampling,
                micro_batch_tokens=self.cfg.trainer.micro_batch_tokens,
                logits_chunk_tokens=self.cfg.trainer.logits_chunk_tokens,
                grad_clip=self.cfg.trainer.grad_clip,
                current_version=self.version,
                ref_model=parts.ref_model,
                world=self.ranks.world,
                device=parts.device,
                audited=audit_table(
                    (s.audit_logprobs, s.logprobs, s.loss_mask)
                    for g in groups
                    for s in g.samples
                    if s.audit_logprobs is not None
                ),
            )
        if stats.skipped:
            log.warning("step %d: loss or grad norm not finite, update skipped", self.step + 1)
        with phase("optimizer"):
            finite = weights_finite(parts.model, self.ranks.world)
        if not finite:
            # Rollout workers must never get them, and no later step can repair them.
            raise SystemExit(
                f"step {self.step + 1} made the weights non-finite (lr {lr:g}): not publishing "
                "them; restart from the last checkpoint with a lower trainer.lr"
            )
        self.state.step += 1
        self.state.version += 1
        with phase("publish"):
            blocking = self._publish()
        step_seconds = time.monotonic() - t_start
        dropped, self.dropped = self.dropped, []
        if self.rank0 is None:
            return
        timing = (step_seconds, wait_seconds, blocking)
        lengths = self.length_bias.step(groups, dropped) | {
            "tokens_lag_masked_fraction": lag_masked_fraction(groups, *token_lag)
        }
        record = self._step_record(groups, staleness, stats, lr, timing, lengths)
        self.rank0.outputs.step(record, staleness, stats)

    def _step_record(
        self,
        groups: list[TrajectoryGroup],
        staleness: list[int],
        stats: StepStats,
        lr: float,
        timing: tuple[float, float, float],
        lengths: dict[str, Any],
    ) -> StepRecord:
        """The loop's figures of the step, and those `train_step` measured (`StepStats.figures`);
        `timing`: the step's seconds, the seconds spent collecting its groups (idle time when the
        rollouts are the bottleneck), and those its publish blocked; `lengths`: the length bias
        (`trainer/length_bias.py`)."""
        step_seconds, wait_seconds, blocking = timing
        rewards = [s.reward for g in groups for s in g.samples]
        peak = self.cfg.trainer.peak_flops
        mfu = None
        if peak:
            flops = 6.0 * self.parts.n_params * stats.processed_tokens
            mfu = flops / max(step_seconds, 1e-9) / (peak * self.ranks.size)
        return StepRecord(
            step=self.step,
            version=self.version,
            wall_seconds=round(self.wall_seconds(), 3),
            groups=len(groups) * self.ranks.size,
            reward_mean=sum(rewards) / max(len(rewards), 1),
            staleness_mean=sum(staleness) / max(len(staleness), 1),
            staleness_max=max(staleness, default=0),
            lr=lr,
            step_seconds=step_seconds,
            wait_seconds=wait_seconds,
            weight_publish_blocking_seconds=blocking,
            weight_sync_seconds=self.state.last_sync_seconds,
            mfu=mfu,
            **lengths,
            **stats.figures(),
            **self.breakdown.take().fields(),
        )

    def _before_optimizer_step(self, *_: object) -> None:
        if self.rank0 is not None:
            with phase("publish"):
                self._copy_wait += self.rank0.publisher.copied()

    def _publish(self) -> float:
        """Hand the current weights to rank 0's publisher; returns the seconds it blocked. A
        sharded model's full tensors are gathered first, with every rank taking part."""
        start = time.perf_counter()
        model = self.parts.model
        params = full_parameters(model) if self.parts.sharded else synced(model)
        if self.rank0 is None:
            return 0.0
        gathered = time.perf_counter() - start
        self._fence()
        record_version(self.cfg.run.path / "checkpoints", self.version)
        # The wait for the previous version's copy, in this step's optimizer step, counts too.
        blocking = gathered + self._copy_wait
        blocking += self.rank0.publisher.publish(params, self.version, defer_copy=True)
        self._copy_wait = 0.0
        self.parts.runtime.redis.call(
            lambda: self.client.set(self.keys.version, self.version), "publish the version"
        )
        self.metrics.policy_version.set(self.version)
        return blocking

    def _checkpoint(self) -> None:
        """Collective: every rank contributes its entry ids and (sharded) state; rank 0 writes."""
        parts = self.parts
        with self.metrics.time_phase("checkpoint"), phase("checkpoint"):
            covered = self.ledger.covered()
            model_state, optimizer_state = full_state(parts.model, parts.optimizer)
            if self.rank0 is not None:
                self._fence()  # a checkpoint of the loser's would be resumed by the holder
                admission = self.rank0.admission
                state = TrainerState(
                    step=self.step,
                    version=self.version,
                    cursor=admission.cursor_dict(),
                    wall_seconds=self.wall_seconds(),
                    covered=covered,
                    counters=admission.counters(),
                    groups_consumed=admission.groups_consumed(self.step),
                    task=self.cfg.task.model_dump(mode="json"),
                )
                save_checkpoint(
                    self.cfg.run.path / "checkpoints",
                    parts.model,
                    model_state,
                    optimizer_state,
                    state,
                    tokenizer_dir=parts.model_dir,
                    keep=self.cfg.trainer.keep_checkpoints,
                )
            self.ranks.barrier()
            self.ledger.checkpointed(self.prefetch.settle)

    def _fence(self) -> None:
        """Rank 0: raise `LeaseLost` unless this trainer still holds the run."""
        lease = self.parts.lease
        if lease is not None:
            self.parts.runtime.redis.call(lease.check, "renew the lease")

    def _evaluate(self) -> None:
        if self.rank0 is None:
            return
        from asyncrl.evaluate import Evaluator

        if self.evaluator is None:
            self.evaluator = Evaluator(
                self.parts.model, self.parts.tokenizer, self.parts.task, self.cfg
            )
        with self.metrics.time_phase("eval"):
            acc = self.evaluator.reward()
        if acc is None:
            log.warning("step %d eval: no held-out item could be scored", self.step)
            return
        record = EvalRecord(
            step=self.step, eval_accuracy=acc, wall_seconds=round(self.wall_seconds(), 3)
        )
        self.rank0.outputs.evaluation(record)
        log.info("step %d eval accuracy %.3f", self.step, acc)


def run_trainer(cfg: Config) -> int:
    return Trainer(cfg).run()
