"""The rollout role: take prompt groups, generate n samples each, score, publish, then ack.

Publishing a trajectory group and acking its prompt happen in one Redis transaction, so a
worker killed at any moment leaves either a whole group or a prompt that is still pending and is
re-claimed once its heartbeat expires (DESIGN §9). SIGTERM drains: the batch in progress is
finished and published, anything read but not started stays pending for another worker.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import time
from typing import Any

import numpy as np

from asyncrl.config import Config
from asyncrl.keys import PROMPTS_GROUP, Keys
from asyncrl.protocol import (
    Limits,
    PromptGroup,
    Sample,
    TrajectoryGroup,
    decode_prompt,
    stream_fields,
)
from asyncrl.redis_conn import connect
from asyncrl.rollout.config import SglangEngineConfig
from asyncrl.rollout.sglang_engine import EngineError
from asyncrl.rollout.tasks import PromptItem

log = logging.getLogger("asyncrl.rollout")


def default_worker_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


class RolloutWorker:
    def __init__(self, cfg: Config, worker_id: str | None = None) -> None:
        from transformers import AutoTokenizer

        from asyncrl.heartbeat import Heartbeat, is_alive
        from asyncrl.metrics import RoleMetrics, serve
        from asyncrl.model import ensure_model
        from asyncrl.queue import Consumer, RedisGuard
        from asyncrl.rollout.engine import build_engine
        from asyncrl.rollout.tasks import build_task
        from asyncrl.trainer.main import resolve_device
        from asyncrl.weights import build_subscriber

        self.cfg = cfg
        self.id = worker_id or default_worker_id()
        self.keys = Keys(cfg.run.id)
        self.client = connect(cfg.redis)
        self.metrics = RoleMetrics("rollout", self.id)
        # The worker's own Redis calls wait out outages like the queue's do.
        self.redis = RedisGuard(
            reconnect_max_s=cfg.redis.reconnect_max_s, on_outage=self.metrics.redis_outage
        )
        self.stopping = False
        device = resolve_device(cfg.trainer.device if cfg.rollout.engine.type == "torch" else "cpu")
        model_dir = ensure_model(cfg, wait_s=600.0 if cfg.model.build_tiny else 0.0)
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.task = build_task(cfg.task, self.tokenizer)
        self.engine = build_engine(
            cfg.rollout.engine, model_path=str(model_dir), device=str(device)
        )
        self.metrics.redis_up.set(1)
        self.subscriber: Any
        if isinstance(cfg.rollout.engine, SglangEngineConfig):
            from asyncrl.weights.sglang import SglangSubscriber

            # SGLang servers take their weights from the trainer directly; this subscriber
            # registers their URLs for the publisher and reports their version.
            self.subscriber = SglangSubscriber(
                cfg.weights,
                self.client,
                self.keys,
                self.id,
                self.engine.urls,  # type: ignore[attr-defined]
            )
        else:
            # Safe to retry: subscribers make their Redis calls before they start any thread.
            self.subscriber = self.redis.call(
                lambda: build_subscriber(
                    cfg.weights,
                    self.client,
                    self.keys,
                    self.id,
                    device=device,
                    on_weights=self._on_weights,
                ),
                "start the weight subscriber",
            )
        self.heartbeat = Heartbeat(
            self.client,
            self.keys.worker("rollout", self.id),
            cfg.rollout.heartbeat_ttl_s,
            lambda: {"version": self.engine.version, "tokens": self.tokens},
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
            reconnect_max_s=cfg.redis.reconnect_max_s,
            on_outage=self.metrics.redis_outage,
        )
        self.limits = Limits(max_message_bytes=cfg.queue.max_message_bytes)
        self.tokens = 0
        if cfg.metrics.port:
            serve(cfg.metrics.host, cfg.metrics.port, self._health)

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
        self.engine.stage_weights(tensors, version)
        self.metrics.policy_version.set(version)

    def _health(self) -> tuple[bool, str]:
        try:
            self.client.ping()
        except Exception as exc:  # any failure to reach Redis means not ready
            return False, f"redis: {type(exc).__name__}"
        if self.subscriber.version is None and self.engine.version == 0:
            return False, "no weights yet"
        return True, "ok"

    def _on_sigterm(self, *_: object) -> None:
        self.stopping = True

    def run(self) -> int:
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
        try:
            while not self.stopping:
                with self.metrics.time_phase("queue_wait"):
                    deliveries = self.consumer.read(
                        self.cfg.rollout.prompts_per_batch, self.cfg.redis.block_ms
                    )
                if deliveries:
                    self._process(deliveries)
        finally:
            self.heartbeat.stop()
            self.subscriber.close()
            close = getattr(self.engine, "close", None)
            if close is not None:
                close()
        return 0

    def _wait_engine_version(self, version: int) -> None:
        """Block until the engine generates with at least `version` (sync mode, bootstrap)."""
        # An idle engine applies staged weights at once, so only the subscriber is waited on.
        while self.engine.version < version and not self.stopping:
            time.sleep(0.005)

    def _drop_failed(
        self,
        deliveries: list[Any],
        prompts: list[PromptGroup],
        flat: list[list[int]],
        exc: EngineError,
    ) -> tuple[list[Any], list[PromptGroup], list[list[int]], list[Any]]:
        """Dead-letter the groups with a failed sample; keep the others for publishing."""
        kept: tuple[list[Any], list[PromptGroup], list[list[int]], list[Any]] = ([], [], [], [])
        offset = 0
        for d, p in zip(deliveries, prompts, strict=True):
            part = exc.generations[offset : offset + p.n]
            if len(part) == p.n and all(g is not None for g in part):
                kept[0].append(d)
                kept[1].append(p)
                kept[2].extend(flat[offset : offset + p.n])
                kept[3].extend(part)
            else:
                self.consumer.dead_letter(d.id, d.fields, f"engine_{exc.reason}", exc.detail)
            offset += p.n
        return kept

    def _process(self, deliveries: list[Any]) -> None:
        prompts: list[PromptGroup] = [d.value for d in deliveries]
        if self.cfg.run.mode == "sync":
            self._wait_engine_version(max(p.release_version for p in prompts))
        created = time.time()
        flat: list[list[int]] = []
        for p in prompts:
            ids = [int(t) for t in p.prompt_ids] or self.tokenizer(p.prompt)["input_ids"]
            flat.extend([ids] * p.n)
        t0 = time.monotonic()
        with self.metrics.time_phase("generate"):
            try:
                gens: list[Any] = self.engine.generate(flat, self.cfg.rollout.sampling)
            except EngineError as exc:
                deliveries, prompts, flat, gens = self._drop_failed(deliveries, prompts, flat, exc)
                if not deliveries:
                    return
        n_tokens = sum(len(g.token_ids) for g in gens)
        self.tokens += n_tokens
        self.metrics.generated(n_tokens, time.monotonic() - t0)
        with self.metrics.time_phase("score"):
            texts = self.tokenizer.batch_decode(
                [g.token_ids.tolist() for g in gens], skip_special_tokens=True
            )
            groups, offset = [], 0
            for d, p in zip(deliveries, prompts, strict=True):
                item = PromptItem(p.prompt_id, p.prompt, flat[offset], p.answer)
                samples = [
                    Sample(
                        response_ids=g.token_ids,
                        logprobs=g.logprobs,
                        versions=g.versions,
                        reward=float(self.task.score(item, text)),
                        finish=g.finish,
                    )
                    for g, text in zip(
                        gens[offset : offset + p.n], texts[offset : offset + p.n], strict=True
                    )
                ]
                offset += p.n
                groups.append(
                    TrajectoryGroup(
                        run=self.keys.run_id,
                        group_id=d.id,
                        prompt_id=p.prompt_id,
                        release_version=p.release_version,
                        worker=self.id,
                        created_at=created,
                        finished_at=time.time(),
                        prompt_ids=np.asarray(item.prompt_ids, np.int32),
                        samples=samples,
                    )
                )
        with self.metrics.time_phase("publish"):
            self.consumer.ack(
                [d.id for d in deliveries],
                also_add=[(self.keys.trajectories, stream_fields(g)) for g in groups],
                counters={"groups_published": len(groups)},
            )
        self.metrics.trajectories_produced.inc(len(groups))


def run_worker(cfg: Config, worker_id: str | None = None) -> int:
    return RolloutWorker(cfg, worker_id).run()
