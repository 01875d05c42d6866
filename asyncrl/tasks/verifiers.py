"""verifiers environments as tasks (`task.type: verifiers`): the items are the taskset's tasks,
read once per role by a verifiers runner (`asyncrl.agents.verifiers`) from the train and eval
selections; an item's `answer` is the task's wire data, from which the runner rebuilds the task
of each episode, as verifiers' own env server does. Episodes and rewards are the runner's:
the task scores no text itself.
"""

from __future__ import annotations

import subprocess
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from asyncrl.agents.verifiers import list_tasks, runner_env
from asyncrl.items import PromptItem
from asyncrl.tasks.base import LazyItems, encode_prompt, epoch_order, use_chat
from asyncrl.tasks.config import TaskConfig, VerifiersTaskConfig

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def check_verifiers(cfg: TaskConfig) -> str | None:
    """A config error when `task.python` cannot import verifiers 0.4 (seconds: roles call it at
    start-up, not the config loader); None otherwise or for other tasks."""
    if not isinstance(cfg, VerifiersTaskConfig):
        return None
    try:
        done = subprocess.run(
            [cfg.python, "-c", "import verifiers.v1"],
            capture_output=True,
            text=True,
            env=runner_env(cfg),
            timeout=300,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"task.python: cannot run {cfg.python} ({exc})"
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["?"])[-1]
        return (
            f"task.python: {cfg.python} cannot import verifiers.v1 ({last}); "
            "pip install 'asyncrl[verifiers]' into that venv"
        )
    return None


class VerifiersTask:
    def __init__(self, cfg: VerifiersTaskConfig, tokenizer: PreTrainedTokenizerBase) -> None:
        self._tokenizer = tokenizer
        self._chat = use_chat(tokenizer, None)
        splits = list_tasks(cfg)
        self._train = splits["train"]
        if not self._train:
            raise ValueError(f"task.train_select: selects no task of {cfg.env!r}")
        self._eval = splits.get("eval", [])

    def train_items(self, seed: int, epoch: int) -> Sequence[PromptItem]:
        rows = self._train
        order = epoch_order(len(rows), seed, epoch)
        return LazyItems(lambda i: self._item("train", rows[i]), order)

    def eval_items(self) -> Sequence[PromptItem]:
        rows = self._eval
        return LazyItems(lambda i: self._item("eval", rows[i]), np.arange(len(rows)))

    def score(self, item: PromptItem, response_text: str) -> float:
        raise RuntimeError("a verifiers episode is scored by its rubric in the runner")

    def _item(self, split: str, row: dict[str, Any]) -> PromptItem:
        ids = encode_prompt(self._tokenizer, row["prompt"], self._chat)
        return PromptItem(f"{split}:{row['idx']}", row["prompt"], ids, row["data"])
