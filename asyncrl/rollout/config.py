"""Config of the rollout pool: how many workers, what each reads and runs at once."""

from __future__ import annotations

from typing import Annotated

from pydantic import Discriminator, Field, Tag, model_validator

from asyncrl.configbase import Section, type_or
from asyncrl.engines.config import SamplingParams, TorchEngineConfig
from asyncrl.gateway.config import GatewayConfig
from asyncrl.sglang.config import SglangEngineConfig

EngineConfig = Annotated[
    Annotated[TorchEngineConfig, Tag("torch")] | Annotated[SglangEngineConfig, Tag("sglang")],
    Discriminator(type_or("torch")),
]
"""The engines a rollout worker may run, by `type`; `type` left out: the builtin engine."""


class RolloutConfig(Section):
    workers: int = Field(default=2, ge=0)
    """Rollout processes that `--role all` starts (other deployments start them themselves)."""
    n: int = Field(default=8, ge=1)
    """Samples generated per prompt (the group size)."""
    prompts_per_batch: int = Field(default=4, ge=1)
    """Most prompt groups a worker takes from the stream in one read."""
    max_inflight_episodes: int | None = Field(default=None, ge=1)
    """Episodes a worker runs at once (n per prompt group). Multi-turn episodes that wait on
    their environment leave the engine to the others, so a slow environment wants many; a
    worker reads prompts while `n` more fit. None: prompts_per_batch × n (one batch at a time,
    as single-turn tasks need)."""
    turn_batch_wait_s: float = Field(default=0.02, ge=0.0)
    """Longest time a multi-turn episode ready for its next turn waits for others coming back
    from their environments, so that they share one generate call (fewer, larger batches)."""
    max_context_tokens: int | None = Field(default=None, ge=2)
    """Most positions an episode's turn may reach: its context (prompt, earlier turns,
    observations) plus `sampling.max_new_tokens`. An episode whose next turn would pass it ends
    before the observation is prefilled, as truncated (finish "length", scored by the task on
    its last turn); before its first turn, its group fails (`context_too_long`). None: the
    model's `max_position_embeddings`, which also caps a larger value."""
    engine: EngineConfig = Field(default_factory=lambda: TorchEngineConfig())
    """The generation engine."""
    sampling: SamplingParams = Field(default_factory=SamplingParams)
    """Sampling parameters; the trainer recomputes log-probs under the same processing."""
    heartbeat_ttl_s: float = Field(default=10.0, gt=0)
    """A worker whose heartbeat is older than this is dead; its prompts are re-claimed."""
    audit_fraction: float = Field(default=0.0, ge=0.0, le=1.0)
    """Share of finished samples the worker rescores through the trainer's forward path
    (`trainer.dtype`, one full forward) with the weights that generated them, shipped as
    `audit_logprobs` for the trainer's lag-0 mismatch figures (`asyncrl mismatch`). A sample
    whose weights were swapped since is not audited. 0: no audit, no cost. Builtin engine only."""
    gateway: GatewayConfig = Field(default_factory=GatewayConfig)
    """The OpenAI-compatible endpoint the worker serves when the task has an `agent`."""
    capture_routing: bool = False
    """Record, per token and MoE layer, the top-k experts the engine routed it to (prompt and
    response tokens), shipped as `routed_experts` for routing replay (`algo.routing_replay`) and
    the routing-agreement figures. Needs a mixture-of-experts model (Qwen3-MoE, Qwen2-MoE,
    Mixtral); an SGLang server must run with `--enable-return-routed-experts`."""

    @model_validator(mode="after")
    def _audit_engine(self) -> RolloutConfig:
        if self.audit_fraction > 0 and self.engine.type != "torch":
            raise ValueError(
                "rollout.audit_fraction needs rollout.engine.type torch (the audit scores "
                f"with the weights in the worker's process), got {self.engine.type!r}"
            )
        return self
