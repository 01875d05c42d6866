"""Held-out evaluation on trainer rank 0, with the builtin engine over the live training weights.

Evaluating in the trainer keeps the figure tied to a known step and version and costs the tiny
quickstart model a fraction of a second; a large model would rather send eval prompts through the
rollout pool.
"""

from __future__ import annotations

from typing import Any

import torch

from asyncrl.config import Config
from asyncrl.rollout.config import TorchEngineConfig
from asyncrl.rollout.tasks import Task
from asyncrl.rollout.torch_engine import TorchEngine


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
        items = task.eval_items()
        self.items = [items[i] for i in range(min(cfg.trainer.eval_size, len(items)))]
        self.params = cfg.rollout.sampling.model_copy(
            update={"temperature": cfg.trainer.eval_temperature}
        )

    @torch.no_grad()
    def accuracy(self) -> float:
        """Mean reward over the held-out prompts (accuracy for 0/1 rewards)."""
        was_training = self.engine.model.training
        gens = self.engine.generate([it.prompt_ids for it in self.items], self.params)
        if was_training:
            self.engine.model.train()
        texts = self.tokenizer.batch_decode(
            [g.token_ids.tolist() for g in gens], skip_special_tokens=True
        )
        scores = [self.task.score(it, t) for it, t in zip(self.items, texts, strict=True)]
        return sum(scores) / max(len(scores), 1)
