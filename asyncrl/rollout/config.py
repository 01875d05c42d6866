"""Config of the rollout pool: how many workers, what each reads and runs at once."""

from pydantic import Field

from asyncrl.configbase import Section
from asyncrl.engines.config import EngineConfig, SamplingParams, TorchEngineConfig


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
    engine: EngineConfig = Field(default_factory=lambda: TorchEngineConfig())
    """The generation engine."""
    sampling: SamplingParams = Field(default_factory=SamplingParams)
    """Sampling parameters; the trainer recomputes log-probs under the same processing."""
    heartbeat_ttl_s: float = Field(default=10.0, gt=0)
    """A worker whose heartbeat is older than this is dead; its prompts are re-claimed."""
