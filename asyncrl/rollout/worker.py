"""The rollout role: take prompt groups, run n episodes each, score, publish, then ack.

Up to `rollout.max_inflight_episodes` episodes run at once (`asyncrl.rollout.episodes`): while
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
"""

from __future__ import annotations

import logging
import os
import random
import signal
import socket
import threading
import time
from typing import TYPE_CHECKING, Any

import numpy as np

from asyncrl.config import Config
from asyncrl.engines.base import InProcessWeights, Rescoring
from asyncrl.items import PromptItem
from asyncrl.protocol import (
    Limits,
    PromptGroup,
    TrajectoryGroup,
    decode_prompt,
    stream_fields,
)
from asyncrl.provenance import prompt_groups
from asyncrl.redis_conn import Stopped, connect
from asyncrl.rollout.episodes import (
    STALE,
    EnvironmentLoopDied,
    EpisodeScheduler,
    FailedGroup,
    FinishedGroup,
    GenerateCall,
)
from asyncrl.runstate import PROMPTS_GROUP, Counter, Keys

if TYPE_CHECKING:
    from asyncrl.queue import Delivery
    from asyncrl.weights.base import WeightSubscriber

    Prompt = Delivery[PromptGroup]

log = logging.getLogger("asyncrl.rollout")
_HOLD_POLL_S = 0.05


def default_worker_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


class RolloutWorker:
    def __init__(self, cfg: Config, worker_id: str | None = None) -> None:
        from transformers import AutoTokenizer

        from asyncrl.device import resolve_device
        from asyncrl.heartbeat import Heartbeat, is_alive
        from asyncrl.metrics.roles import RoleMetrics
        from asyncrl.metrics.server import serve
        from asyncrl.model import ensure_model, max_positions, vocab_size
        from asyncrl.model_identity import model_identity
        from asyncrl.queue import Consumer
        from asyncrl.redis_conn import RedisGuard
        from asyncrl.rollout.backends import build_engine, build_subscriber, kept_dtype
        from asyncrl.tasks.build import build_task

        self.cfg = cfg
        self.id = worker_id or default_worker_id()
        self.keys = Keys(cfg.run.id)
        self.client = connect(cfg.redis)
        self.metrics = RoleMetrics("rollout", self.id)
        if cfg.metrics.port:
            # Before the model loads and the weight group is joined: a port another process
            # holds ends the worker at once.
            serve(cfg.metrics.host, cfg.metrics.port, self._health)
        self.stopping = False
        self.abandoning = False
        """A second SIGTERM: leave without finishing the episodes in flight."""
        # The worker's own Redis calls wait out outages like the queue's do, until SIGTERM.
        self.redis = RedisGuard(
            reconnect_max_s=cfg.redis.reconnect_max_s,
            should_stop=lambda: self.stopping,
            on_outage=self.metrics.redis_outage,
        )
        engine_cfg = cfg.rollout.engine
        # Weights are received where the engine holds them; servers of their own hold theirs.
        device = resolve_device(engine_cfg.device if engine_cfg.type == "torch" else "cpu")
        model_dir = ensure_model(cfg, wait_s=600.0 if cfg.model.build_tiny else 0.0)
        self.model_dir = model_dir
        self.identity = model_identity(model_dir, cfg.model.lora)
        self.identity_checked = False
        """Whether the trainer's model identity was found equal to ours (`_check_model`)."""
        # Before it starts an engine, or registers for weights no broadcast could give it.
        self._check_model()
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.task = build_task(cfg.task, self.tokenizer)
        self.engine = build_engine(
            engine_cfg,
            model_path=str(model_dir),
            lora=cfg.model.lora,
            capture_routing=cfg.rollout.capture_routing,
        )
        self.metrics.redis_up.set(1)
        # Safe to retry: subscribers make their Redis calls before they start any thread.
        self.subscriber: WeightSubscriber = self.redis.call(
            lambda: build_subscriber(
                cfg.weights,
                self.client,
                self.keys,
                self.id,
                device=device,
                on_weights=self._on_weights,
                engine=self.engine,
                keeps_dtype=kept_dtype(self.engine),
            ),
            "start the weight subscriber",
        )
        self.heartbeat = Heartbeat(
            self.client,
            self.keys.worker("rollout", self.id),
            cfg.rollout.heartbeat_ttl_s,
            lambda: {"version": self.engine.version, "tokens": self.episodes.tokens},
        )
        self.consumer = Consumer(
            self.client,
            self.keys.prompts,
            PROMPTS_GROUP,
            self.id,
            cfg.queue,
            dlq=self.keys.dlq,
            counters_key=self.keys.counters,
            is_alive=is_alive(self.client, self.keys, "rollout"),
            decode=self._decode,
            groups=prompt_groups(self.keys),
            guard=self.redis,
        )
        self.limits = Limits(
            max_message_bytes=cfg.queue.max_message_bytes, vocab_size=vocab_size(model_dir)
        )
        rollout = cfg.rollout
        self.max_inflight = rollout.max_inflight_episodes or rollout.prompts_per_batch * rollout.n
        self.episodes: EpisodeScheduler[Prompt] = EpisodeScheduler(
            self.engine,
            self.task,
            self.tokenizer,
            rollout.sampling,
            batch_wait_s=rollout.turn_batch_wait_s,
            max_context=_least(rollout.max_context_tokens, max_positions(model_dir)),
            on_generate=self._on_generate,
            on_env_error=lambda reason: self.metrics.environment_errors[reason].inc(),
            on_tool_calls=lambda outcome, n: self.metrics.tool_calls[outcome].inc(n),
        )
        self.waiting: list[Prompt] = []
        """Prompt deliveries read but not started: waiting for newer weights."""
        self.read_at: dict[str, float] = {}
        """When each waiting delivery was read (monotonic)."""
        self.weights_arrived = threading.Event()
        """Set by the weight-sync thread, so that a worker holding prompts wakes at once."""
        # Generation-side staleness bound: see `_admit`.
        self.max_lag = 0 if cfg.run.mode == "sync" else cfg.algo.max_staleness
        self.max_hold_s = 2 * cfg.weights.sync_timeout_s
        self.audit_rng = random.Random(self.id)
        """Picks the samples `rollout.audit_fraction` rescores."""

    def _decode(self, fields: dict[bytes, bytes]) -> PromptGroup:
        from asyncrl.protocol import ValidationError

        data = fields.get(b"data")
        if data is None:
            raise ValidationError("malformed", "entry has no data field")
        return decode_prompt(data, self.limits)

    def _on_weights(self, tensors: Any, version: int) -> None:
        # A joining worker may be sent the version its model directory already holds.
        if version <= self.engine.version:
            return
        # Only in-process transports hand over tensors, and only to such engines.
        assert isinstance(self.engine, InProcessWeights)
        self.engine.stage_weights(tensors, version)
        self.metrics.policy_version.set(version)
        self.weights_arrived.set()

    def _health(self) -> tuple[bool, str]:
        try:
            self.client.ping()
        except Exception as exc:  # any failure to reach Redis means not ready
            return False, f"redis: {type(exc).__name__}"
        if not hasattr(self, "subscriber"):  # probed while __init__ still builds the worker
            return False, "starting"
        if self.subscriber.version is None and self.engine.version == 0:
            return False, "no weights yet"
        return True, "ok"

    def _on_sigterm(self, *_: object) -> None:
        self.abandoning = self.stopping
        self.stopping = True

    def run(self) -> int:
        from redis import RedisError

        signal.signal(signal.SIGTERM, self._on_sigterm)
        self.heartbeat.start()
        published = self.redis.call(
            lambda: self.client.get(self.keys.version), "read the published version"
        )
        target = 0 if published is None else int(published)
        # A joining worker first holds the latest published weights, then generates. The model
        # directory is version 0, so a fresh run starts at once.
        if target > self.engine.version:
            self.subscriber.wait_for_version(target, timeout_s=self.cfg.weights.sync_timeout_s * 10)
            self._wait_engine_version(target)
        log.info("rollout %s ready at version %d", self.id, self.engine.version)
        dropped_at = self.engine.version  # the version groups were last checked for staleness
        code = 0
        try:
            while not self.stopping or (self.episodes.inflight and not self.abandoning):
                if not self.stopping:
                    self._admit()
                if not self.episodes.inflight:
                    if self.waiting:
                        # Every prompt held waits for newer weights: wake when they come, and
                        # look for new prompts (maybe fresh enough) now and then, not in a spin.
                        self.weights_arrived.wait(_HOLD_POLL_S)
                        self.weights_arrived.clear()
                    continue
                # With room for more groups, come back soon to read them; else only a returning
                # environment step (or SIGTERM, checked every second) has anything to do.
                room = self._room() >= self.cfg.rollout.n
                if self.engine.version != dropped_at:
                    dropped_at = self.engine.version
                    self.episodes.drop_older_than(dropped_at - self.max_lag)
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
            self.heartbeat.stop()
            self.episodes.close()
            try:
                self.subscriber.close()
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
        while self.engine.version < version and not self.stopping:
            time.sleep(0.005)

    def _room(self) -> int:
        """Episodes that may still start; prompts held for their weights count as n each."""
        held = self.episodes.inflight + len(self.waiting) * self.cfg.rollout.n
        return self.max_inflight - held

    def _check_model(self) -> None:
        """Compare our model with the trainer's until one has published it; ModelMismatch when
        they differ. Checked before every read of prompts until then: the trainer publishes it
        before it releases any, so no prompt of a trainer reaches a worker of another model."""
        from asyncrl.model_identity import check_identity

        if not self.identity_checked:
            self.identity_checked = self.redis.call(
                lambda: check_identity(self.client, self.keys, self.identity, self.model_dir),
                "read the run's model identity",
            )

    def _admit(self) -> None:
        """Read prompts while there is room (without waiting when episodes are in flight), and
        start those whose weights are fresh enough.

        A group is trained at its release version or later, so one generated with weights older
        than `release_version − η` is dropped as stale for sure: such a prompt waits for newer
        weights instead (the generation side of the staleness bound; sync mode is η = 0). A
        worker whose weight sync is stuck must not hold its prompts, and with them admission's
        budget, forever: after twice `weights.sync_timeout_s` it generates anyway, and the
        trainer drops what turns out stale, which frees the budget."""
        self._check_model()
        busy = bool(self.episodes.inflight or self.waiting)
        count = min(self.cfg.rollout.prompts_per_batch, self._room() // self.cfg.rollout.n)
        if count > 0 or not busy:
            with self.metrics.time_phase("queue_wait"):
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

    def _on_generate(self, call: GenerateCall) -> None:
        self.metrics.time_seconds["generate"].inc(call.seconds)
        self.metrics.generated(
            call.response_tokens, call.seconds, call.prompt_tokens, call.cached_tokens
        )

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
        with self.metrics.time_phase("publish"):
            self.consumer.ack(
                [f.tag.id for f in finished],
                also_add=[(self.keys.trajectories, stream_fields(g)) for g in groups],
                counters={Counter.GROUPS_PUBLISHED: len(groups)},
            )
        self.metrics.trajectories_produced.inc(len(groups))

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


def _least(*limits: int | None) -> int | None:
    """The tightest of the limits given; None when none is."""
    return min((n for n in limits if n is not None), default=None)


def run_worker(cfg: Config, worker_id: str | None = None) -> int:
    return RolloutWorker(cfg, worker_id).run()
