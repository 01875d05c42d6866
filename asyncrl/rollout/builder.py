"""Builds what a rollout worker needs, one small function per piece, into one typed record.

Order matters: the runtime serves the metrics port first (a port another process holds ends the
worker before the model loads and the weight group is joined); the worker's model is compared
with the run's before it starts an engine or registers for weights no broadcast could give it;
the weight subscriber makes its Redis calls before it starts any thread, so building it is
retried through an outage like any of the worker's Redis calls.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from asyncrl.engines.base import InProcessWeights
from asyncrl.protocol import PromptGroup, decode_prompt
from asyncrl.rollout.scheduler import EpisodeScheduler
from asyncrl.rollout.timing import WorkerTiming
from asyncrl.runstate import PROMPTS_GROUP
from asyncrl.runtime import RoleRuntime, open_runtime

if TYPE_CHECKING:
    from pathlib import Path

    from transformers import PreTrainedTokenizerBase

    from asyncrl.agents.episode import AgentEpisodes
    from asyncrl.config import Config
    from asyncrl.engines.base import RolloutEngine
    from asyncrl.heartbeat import Heartbeat
    from asyncrl.metrics.roles import RoleMetrics
    from asyncrl.model_identity import ModelIdentity
    from asyncrl.queue import Consumer, Delivery
    from asyncrl.rollout.turns import GenerateCall
    from asyncrl.tasks.base import Task
    from asyncrl.weights.base import WeightSubscriber

    Prompt = Delivery[PromptGroup]

log = logging.getLogger(__name__)


@dataclass
class ModelCheck:
    """Compares our model with the trainer's until one has published it (`ModelMismatch` when
    they differ). The trainer publishes it before it releases any prompt, so a worker that checks
    before every read of prompts until then gets no prompt of a trainer of another model."""

    runtime: RoleRuntime
    model_dir: Path
    identity: ModelIdentity
    checked: bool = False
    """Whether the trainer's model identity was found equal to ours."""

    def __call__(self) -> None:
        from asyncrl.model_identity import check_identity

        rt = self.runtime
        if not self.checked:
            self.checked = rt.redis.call(
                lambda: check_identity(rt.client, rt.keys, self.identity, self.model_dir),
                "read the run's model identity",
            )


@dataclass(frozen=True)
class RolloutParts:
    runtime: RoleRuntime
    check_model: ModelCheck
    tokenizer: PreTrainedTokenizerBase
    engine: RolloutEngine
    subscriber: WeightSubscriber
    weights_arrived: threading.Event
    """Set by the weight-sync thread, so that a worker holding prompts wakes at once."""
    episodes: EpisodeScheduler[Prompt]
    consumer: Consumer[PromptGroup]
    heartbeat: Heartbeat
    max_inflight: int
    """Episodes run at once: `rollout.max_inflight_episodes`, or a batch's worth."""
    timing: WorkerTiming


def weights_handler(
    engine: RolloutEngine, metrics: RoleMetrics, arrived: threading.Event
) -> Callable[[Any, int], None]:
    """The subscriber's `on_weights`: stage newer tensors into the engine."""

    def on_weights(tensors: Any, version: int) -> None:
        # A joining worker may be sent the version its model directory already holds.
        if version <= engine.version:
            return
        # Only in-process transports hand over tensors, and only to such engines.
        assert isinstance(engine, InProcessWeights)
        engine.stage_weights(tensors, version)
        metrics.policy_version.set(version)
        arrived.set()

    return on_weights


def weights_ready(subscriber: WeightSubscriber, engine: RolloutEngine) -> tuple[bool, str]:
    if subscriber.version is None and engine.version == 0:
        return False, "no weights yet"
    return True, "ok"


def _starting() -> tuple[bool, str]:
    return False, "starting"


def build_subscriber_retried(
    rt: RoleRuntime, engine: RolloutEngine, on_weights: Callable[[Any, int], None]
) -> WeightSubscriber:
    from asyncrl.device import resolve_device
    from asyncrl.rollout.backends import build_subscriber, kept_dtype

    engine_cfg = rt.cfg.rollout.engine
    # Weights are received where the engine holds them; servers of their own hold theirs.
    device = resolve_device(engine_cfg.device if engine_cfg.type == "torch" else "cpu")
    # Safe to retry: subscribers make their Redis calls before they start any thread.
    return rt.redis.call(
        lambda: build_subscriber(
            rt.cfg.weights,
            rt.client,
            rt.keys,
            rt.name,
            device=device,
            on_weights=on_weights,
            engine=engine,
            keeps_dtype=kept_dtype(engine),
        ),
        "start the weight subscriber",
    )


def build_episodes(
    rt: RoleRuntime,
    engine: RolloutEngine,
    task: Task,
    tokenizer: PreTrainedTokenizerBase,
    model_dir: Path,
) -> EpisodeScheduler[Prompt]:
    from asyncrl.model import max_positions

    rollout, metrics = rt.cfg.rollout, rt.metrics

    def on_generate(call: GenerateCall) -> None:
        metrics.time_seconds["generate"].inc(call.seconds)
        metrics.generated(
            call.response_tokens, call.seconds, call.prompt_tokens, call.cached_tokens
        )

    return EpisodeScheduler(
        engine,
        task,
        tokenizer,
        rollout.sampling,
        batch_wait_s=rollout.turn_batch_wait_s,
        max_context=_least(rollout.max_context_tokens, max_positions(model_dir)),
        on_generate=on_generate,
        on_env_error=lambda reason: metrics.environment_errors[reason].inc(),
        on_tool_calls=lambda outcome, n: metrics.tool_calls[outcome].inc(n),
        kind=build_agents(rt, tokenizer, model_dir),
    )


def build_agents(
    rt: RoleRuntime, tokenizer: PreTrainedTokenizerBase, model_dir: Path
) -> AgentEpisodes | None:
    """The task's agent over a gateway of this worker's; None when the task has no agent."""
    from asyncrl.agents.episode import AgentEpisodes
    from asyncrl.gateway.server import CallStats, Gateway
    from asyncrl.model import vocab_size
    from asyncrl.tasks.build import build_agent
    from asyncrl.tasks.config import agent_of

    agent = agent_of(rt.cfg.task)
    if agent is None:
        return None
    metrics = rt.metrics

    def on_call(call: CallStats) -> None:
        metrics.gateway_calls.inc()
        metrics.gateway_call_seconds.observe(call.seconds)
        metrics.gateway_tokens["prompt"].inc(call.prompt_tokens)
        metrics.gateway_tokens["generated"].inc(call.output_tokens)
        if call.cause is not None:
            metrics.gateway_stitch_breaks[call.cause].inc()

    gateway = Gateway(rt.cfg.rollout.gateway, tokenizer, vocab_size(model_dir), on_call)
    log.info("gateway for task.agent at %s", gateway.url)
    return AgentEpisodes(build_agent(agent), agent, gateway, metrics.gateway_sessions.inc)


def _least(*limits: int | None) -> int | None:
    """The tightest of the limits given; None when none is."""
    return min((n for n in limits if n is not None), default=None)


def build(cfg: Config, worker_id: str) -> RolloutParts:
    from asyncrl.model_identity import model_identity
    from asyncrl.provenance import prompt_groups
    from asyncrl.rollout.backends import build_engine

    rt = open_runtime(cfg, "rollout", worker_id, ready=_starting)
    # A worker beside a trainer that builds the tiny model waits for it rather than build it too.
    model_dir = rt.model_dir(wait_s=600.0 if cfg.model.build_tiny else 0.0)
    check_model = ModelCheck(rt, model_dir, model_identity(model_dir, cfg.model.lora))
    check_model()
    tokenizer = rt.tokenizer(model_dir)
    task = rt.task(tokenizer)
    engine = build_engine(
        cfg.rollout.engine,
        model_path=str(model_dir),
        lora=cfg.model.lora,
        capture_routing=cfg.rollout.capture_routing,
    )
    rt.metrics.redis_up.set(1)
    arrived = threading.Event()
    subscriber = build_subscriber_retried(rt, engine, weights_handler(engine, rt.metrics, arrived))
    rt.ready = lambda: weights_ready(subscriber, engine)
    episodes = build_episodes(rt, engine, task, tokenizer, model_dir)
    limits = rt.limits(model_dir)
    rollout = cfg.rollout
    timing = WorkerTiming(rt, lambda: engine.version, lambda: episodes.tokens)
    return RolloutParts(
        runtime=rt,
        check_model=check_model,
        tokenizer=tokenizer,
        engine=engine,
        subscriber=subscriber,
        weights_arrived=arrived,
        episodes=episodes,
        consumer=rt.consumer(
            rt.keys.prompts,
            PROMPTS_GROUP,
            prompt_groups(rt.keys),
            decode=lambda data: decode_prompt(data, limits),
        ),
        heartbeat=rt.heartbeat(
            lambda: {"version": engine.version, "tokens": episodes.tokens, "time": timing.last}
        ),
        max_inflight=rollout.max_inflight_episodes or rollout.prompts_per_batch * rollout.n,
        timing=timing,
    )
