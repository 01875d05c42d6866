"""Held-out evaluation on trainer rank 0, with the builtin engine over the live training weights.

Evaluating in the trainer keeps the figure tied to a known step and version and costs the tiny
quickstart model a fraction of a second; a large model would rather send eval prompts through the
rollout pool. Held-out items run as whole episodes through the rollout side's `EpisodeScheduler`,
so a multi-turn task is scored on every turn (with its real environment) and a one-turn task on
its single response, exactly as rollouts are rewarded. An agent task (`task.agent`, a verifiers
environment) runs its agent against a gateway of the evaluation's own on loopback, made for each
evaluation and closed with it, so its held-out reward is the agent's, as in rollouts.

A module of the package root because it joins the two sides: the trainer calls it, and it drives
the rollout side's scheduler. Placed in either package it would make one import the other.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from asyncrl.config import Config
from asyncrl.engines.base import RolloutEngine
from asyncrl.engines.config import SamplingParams, TorchEngineConfig
from asyncrl.engines.torch_engine import TorchEngine
from asyncrl.items import PromptItem
from asyncrl.rollout.scheduler import EpisodeScheduler
from asyncrl.tasks.base import Task
from asyncrl.tasks.config import agent_of

if TYPE_CHECKING:
    from asyncrl.agents.episode import AgentEpisodes

log = logging.getLogger(__name__)

_ADVANCE_WAIT_S = 0.05


def held_out_reward(
    engine: RolloutEngine,
    task: Task,
    tokenizer: Any,
    items: Sequence[PromptItem],
    params: SamplingParams,
    samples: int = 1,
    agents: AgentEpisodes | None = None,
    max_context: int | None = None,
) -> float | None:
    """Mean episode reward over `samples` episodes of each item (accuracy for 0/1 rewards).

    Episodes whose group fails (an environment error, say) are left out and logged: one broken
    item must not stop training, and a zero would read as a wrong answer. None when every item
    failed (or there were none): there is no figure to report then."""
    episodes: EpisodeScheduler[int] = EpisodeScheduler(
        engine, task, tokenizer, params, max_context=max_context, kind=agents
    )
    rewards: list[float] = []
    try:
        for i, item in enumerate(items):
            episodes.start(i, item, samples, f"eval/{i}")
        while episodes.inflight:
            finished, failed = episodes.advance(_ADVANCE_WAIT_S)
            rewards += [s.reward for g in finished for s in g.samples]
            for f in failed:
                log.warning("held-out item %d left out: %s (%s)", f.tag, f.reason, f.detail)
    finally:
        episodes.close()
    return sum(rewards) / len(rewards) if rewards else None


class Evaluator:
    def __init__(self, model: Any, tokenizer: Any, task: Task, cfg: Config) -> None:
        eos = tokenizer.eos_token_id
        # Evaluation always runs the builtin engine here, whatever engine the rollouts use.
        engine_cfg = cfg.rollout.engine
        if not isinstance(engine_cfg, TorchEngineConfig):
            engine_cfg = TorchEngineConfig()
        self.engine = TorchEngine(
            model,
            eos_token_ids=[] if eos is None else [eos],
            max_batch_size=engine_cfg.max_batch_size,
            seed=cfg.run.seed + 1,
        )
        self.tokenizer = tokenizer
        self.task = task
        self.agent = agent_of(cfg.task)
        text = model.config.get_text_config()
        self.vocab_size = int(text.vocab_size)
        limits = (cfg.rollout.max_context_tokens, getattr(text, "max_position_embeddings", None))
        self.max_context = min((int(n) for n in limits if n is not None), default=None)
        items = task.eval_items()
        self.items = [items[i] for i in range(min(cfg.trainer.eval_size, len(items)))]
        self.samples = cfg.trainer.eval_samples
        self.params = cfg.rollout.sampling.model_copy(
            update={"temperature": cfg.trainer.eval_temperature}
        )

    def reward(self) -> float | None:
        """Mean reward of the live weights over the held-out items (None: none could be scored)."""
        return held_out_reward(
            self.engine,
            self.task,
            self.tokenizer,
            self.items,
            self.params,
            self.samples,
            self._agents(),
            self.max_context,
        )

    def _agents(self) -> AgentEpisodes | None:
        """The agent over a fresh loopback gateway (the scheduler closes both with it)."""
        if self.agent is None:
            return None
        from asyncrl.agents.episode import AgentEpisodes
        from asyncrl.gateway.config import GatewayConfig
        from asyncrl.gateway.server import Gateway
        from asyncrl.tasks.build import build_agent

        gateway = Gateway(GatewayConfig(), self.tokenizer, self.vocab_size)
        return AgentEpisodes(build_agent(self.agent), self.agent, gateway)
