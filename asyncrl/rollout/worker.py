"""The rollout role: take prompt groups, run n episodes each, score, publish, then ack.

Up to `rollout.max_inflight_episodes` episodes run at once (`asyncrl.rollout.scheduler`): while
some wait on their environment, the engine generates for the others, and prompts are read as
room frees up. Each group is published as soon as its n episodes have ended. Publishing a
trajectory group and acking its prompt happen in one Redis transaction, so a worker killed at
any moment leaves either a whole group or a prompt that is still pending and is re-claimed once
its heartbeat expires (DESIGN §9). SIGTERM drains: episodes in flight are finished and their
groups published; prompts read but not started stay pending for another worker. A second
SIGTERM (or Ctrl-C) stops at once: episodes in flight are abandoned, their prompts stay pending
and are delivered again, and their environments are closed (sessions on env-servers deleted,
best effort within a few seconds). A worker that
is told to stop while Redis is unreachable stops waiting for it: what it has not published stays
pending and is delivered again. A worker whose environments' event loop died (user code got
past every guard) exits 1 with one line saying so: its heartbeat stops, so its prompts are
taken over, rather than a live worker holding them forever.

`builder` makes the pieces (over the runtime the trainer's builder uses too); this module is the
loop.
"""

from __future__ import annotations

import logging
import os
import random
import signal
import socket
import time
from typing import TYPE_CHECKING

import numpy as np

from asyncrl.config import Config
from asyncrl.engines.base import Rescoring
from asyncrl.items import PromptItem
from asyncrl.metrics.breakdown import phase
from asyncrl.profiling import StepProfiler
from asyncrl.protocol import PromptGroup, TrajectoryGroup, stream_fields
from asyncrl.redis_conn import Stopped
from asyncrl.rollout.builder import build
from asyncrl.rollout.env_loop import EnvironmentLoopDied
from asyncrl.rollout.groups import STALE, FailedGroup, FinishedGroup
from asyncrl.runstate import Counter

if TYPE_CHECKING:
    from asyncrl.rollout.builder import Prompt

log = logging.getLogger("asyncrl.rollout")
_HOLD_POLL_S = 0.05


def default_worker_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


class RolloutWorker:
    def __init__(self, cfg: Config, worker_id: str | None = None) -> None:
        self.cfg = cfg
        self.parts = build(cfg, worker_id or default_worker_id())
        rt = self.parts.runtime
        self.id = rt.name
        self.keys = rt.keys
        self.client = rt.client
        self.metrics = rt.metrics
        self.stop = rt.stop
        self.redis = rt.redis
        self.engine = self.parts.engine
        self.episodes = self.parts.episodes
        self.consumer = self.parts.consumer
        self.tokenizer = self.parts.tokenizer
        self.waiting: list[Prompt] = []
        """Prompt deliveries read but not started: waiting for newer weights."""
        self.read_at: dict[str, float] = {}
        """When each waiting delivery was read (monotonic)."""
        # Generation-side staleness bound: see `_admit`.
        self.max_lag = rt.max_staleness
        self.give_up_stale = cfg.algo.stale_policy == "drop"
        """Give up groups in flight that fell more than η behind (`stale_policy: drop` only:
        under `train` an episode goes on with new weights and is trained)."""
        self.max_hold_s = 2 * cfg.weights.sync_timeout_s
        self.audit_rng = random.Random(self.id)
        """Picks the samples `rollout.audit_fraction` rescores."""
        self.profiler = StepProfiler(cfg.profile, "rollout", self.id, cfg.run.path)

    def run(self) -> int:
        from redis import RedisError

        signal.signal(signal.SIGTERM, self.stop.on_sigterm)
        self.parts.timing.start()
        self.parts.heartbeat.start()
        published = self.redis.call(
            lambda: self.client.get(self.keys.version), "read the published version"
        )
        target = 0 if published is None else int(published)
        # A joining worker first holds the latest published weights, then generates. The model
        # directory is version 0, so a fresh run starts at once.
        if target > self.engine.version:
            with phase("hold"):
                self.parts.subscriber.wait_for_version(
                    target, timeout_s=self.cfg.weights.sync_timeout_s * 10
                )
                self._wait_engine_version(target)
        log.info("rollout %s ready at version %d", self.id, self.engine.version)
        dropped_at = self.engine.version  # the version groups were last checked for staleness
        code = 0
        turns = 0  # turns of the loop that advanced episodes: the steps `profile` counts
        try:
            while not self.stop.stopping or (self.episodes.inflight and not self.stop.abandoning):
                self.parts.timing.tick()
                if not self.stop.stopping:
                    self._admit()
                if not self.episodes.inflight:
                    if self.waiting:
                        # Every prompt held waits for newer weights: wake when they come, and
                        # look for new prompts (maybe fresh enough) now and then, not in a spin.
                        with phase("hold"):
                            self.parts.weights_arrived.wait(_HOLD_POLL_S)
                        self.parts.weights_arrived.clear()
                    continue
                # With room for more groups, come back soon to read them; else only a returning
                # environment step (or SIGTERM, checked every second) has anything to do.
                room = self._room() >= self.cfg.rollout.n
                if self.give_up_stale and self.engine.version != dropped_at:
                    dropped_at = self.engine.version
                    self.episodes.drop_older_than(dropped_at - self.max_lag)
                turns += 1
                with self.profiler.step(turns):
                    finished, failed = self.episodes.advance(0.05 if room else 1.0)
                self._publish(finished, failed)
        except Stopped as exc:
            log.warning(
                "rollout %s: stopped while waiting for Redis (%s); the prompts of groups not "
                "published stay pending and are delivered again",
                self.id,
                exc,
            )
        except EnvironmentLoopDied as exc:
            log.error("rollout %s: %s; stopping (its prompts are delivered again)", self.id, exc)
            code = 1
        finally:
            # Stopping already: a later SIGTERM must not kill the exit (Python restores the
            # default disposition of handled signals while it finalises).
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            if self.episodes.inflight:
                log.warning(
                    "rollout %s: %d episode(s) in flight abandoned; their prompts stay pending "
                    "and are delivered again",
                    self.id,
                    self.episodes.inflight,
                )
            self.parts.timing.close()
            self.parts.heartbeat.stop()
            self.episodes.close()
            try:
                self.parts.subscriber.close()
            except RedisError as exc:
                # Redis is unreachable: the registration lapses by itself with its lease.
                log.warning("rollout %s: could not leave the weight sync: %s", self.id, exc)
            close = getattr(self.engine, "close", None)
            if close is not None:
                close()
        return code

    def _wait_engine_version(self, version: int) -> None:
        """Block until the engine generates with at least `version` (bootstrap)."""
        # An idle engine applies staged weights at once, so only the subscriber is waited on.
        while self.engine.version < version and not self.stop.stopping:
            time.sleep(0.005)

    def _room(self) -> int:
        """Episodes that may still start; prompts held for their weights count as n each."""
        held = self.episodes.inflight + len(self.waiting) * self.cfg.rollout.n
        return self.parts.max_inflight - held

    def _admit(self) -> None:
        """Read prompts while there is room (without waiting when episodes are in flight), and
        start those whose weights are fresh enough.

        A group is trained at its release version or later, so one started with weights older
        than `release_version − η` would start out staler than η (under `stale_policy: drop`,
        dropped for sure): such a prompt waits for newer weights instead (the generation side
        of the staleness bound, where work starts; sync mode is η = 0). A
        worker whose weight sync is stuck must not hold its prompts, and with them admission's
        budget, forever: after twice `weights.sync_timeout_s` it generates anyway, and the
        trainer trains it corrected (or, under `stale_policy: drop`, drops it, which frees the
        budget)."""
        self.parts.check_model()
        busy = bool(self.episodes.inflight or self.waiting)
        count = min(self.cfg.rollout.prompts_per_batch, self._room() // self.cfg.rollout.n)
        if count > 0 or not busy:
            with self.metrics.time_phase("queue_wait"), phase("hold"):
                self.waiting.extend(
                    self.consumer.read(max(count, 1), 0 if busy else self.cfg.redis.block_ms)
                )
        held = []
        now = time.monotonic()
        for d in self.waiting:
            p: PromptGroup = d.value
            read_at = self.read_at.setdefault(d.id, now)
            fresh = self.engine.version >= p.release_version - self.max_lag
            if not fresh and (self.max_lag == 0 or now - read_at < self.max_hold_s):
                held.append(d)
                continue
            self.read_at.pop(d.id)
            ids = [int(t) for t in p.prompt_ids] or self.tokenizer(p.prompt)["input_ids"]
            self.episodes.start(d, PromptItem(p.prompt_id, p.prompt, ids, p.answer), p.n, d.id)
        self.waiting = held

    def _publish(
        self, finished: list[FinishedGroup[Prompt]], failed: list[FailedGroup[Prompt]]
    ) -> None:
        """Dead-letter the failed groups; publish the finished ones and ack their prompts in one
        transaction."""
        for f in failed:
            if f.reason == STALE:  # the trainer would drop it: counted so, no dead letter
                self.consumer.drop(f.tag.id, Counter.GROUPS_DROPPED_STALE, value=f.tag.value)
                self.metrics.rollout_groups_dropped_stale.inc()
                continue
            self.consumer.dead_letter(f.tag.id, f.tag.fields, f.reason, f.detail)
            by_reason = self.metrics.rollout_groups_failed
            (by_reason.get(f.reason) or by_reason["other"]).inc()
        if not finished:
            return
        if self.cfg.rollout.audit_fraction and isinstance(self.engine, Rescoring):
            self._audit(finished, self.engine)
        now = time.time()
        groups = [
            TrajectoryGroup(
                run=self.keys.run_id,
                group_id=f.tag.id,
                prompt_id=f.item.prompt_id,
                release_version=f.tag.value.release_version,
                worker=self.id,
                created_at=f.created_at,
                finished_at=now,
                prompt_ids=np.asarray(f.item.prompt_ids, np.int32),
                samples=f.samples,
            )
            for f in finished
        ]
        with self.metrics.time_phase("publish"), phase("publish"):
            self.consumer.ack(
                [f.tag.id for f in finished],
                also_add=[(self.keys.trajectories, stream_fields(g)) for g in groups],
                counters={Counter.GROUPS_PUBLISHED: len(groups)},
            )
        self.metrics.trajectories_produced.inc(len(groups))
        self.parts.timing.published(len(groups))

    def _audit(self, finished: list[FinishedGroup[Prompt]], engine: Rescoring) -> None:
        """Rescore a sample of `finished` through the trainer's forward path with the weights
        that generated them (`Sample.audit_logprobs`): samples whose tokens all come from the
        weights loaded now, since older ones are gone."""
        version, fraction = self.engine.version, self.cfg.rollout.audit_fraction
        picked = [
            (f.item.prompt_ids, s)
            for f in finished
            for s in f.samples
            if len(s.versions)
            and bool((s.versions == version).all())
            and self.audit_rng.random() < fraction
        ]
        if not picked:
            return
        sequences = [([*p, *s.response_ids.tolist()], len(p)) for p, s in picked]
        try:
            used, scores = engine.rescore(
                sequences, self.cfg.rollout.sampling, self.cfg.trainer.dtype
            )
        except RuntimeError as exc:  # e.g. out of memory: the groups go out unaudited
            log.warning("rollout %s: mismatch audit failed: %s", self.id, exc)
            return
        if used != version:
            return  # new weights landed in between: these are not the sampling weights any more
        for (_, s), logp in zip(picked, scores, strict=True):
            # Under top-k/top-p the recomputation may put a sampled token outside the kept set
            # (-inf): the wire has no place for it, and the trainer's table sees it anyway.
            if not np.isfinite(logp).all():
                continue
            if s.loss_mask is not None:
                logp = np.where(s.loss_mask > 0, logp, 0.0)
            s.audit_logprobs = np.minimum(logp, 0.0).astype(np.float32)


def run_worker(cfg: Config, worker_id: str | None = None) -> int:
    return RolloutWorker(cfg, worker_id).run()
