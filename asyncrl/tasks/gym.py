"""reasoning-gym datasets as tasks: seeded procedural problems, scored by the dataset's own code.

Prompts are the items' `question`s (as a chat user turn when the tokenizer has a template). The
response's answer is the content of its last `<answer>...</answer>` (reasoning-gym's own
`extract_answer`, the format its instructions ask for), or the whole response when it has no
such tag, so a model that answers bare still gets scored; the dataset's
`score_answer(answer, entry)` gives the reward, often partial credit below 1.0.

The held-out split comes from another seed (`eval_seed`, default `seed + size`: several
generators seed item i with `seed + i`, so `seed + 1` would replay the train items shifted by
one). Generators with a small problem space repeat problems across seeds, so train items whose
question is also held out are removed: the held-out split stays unseen.

Items are generated once when the task is built (train and held-out splits, in every process);
positions index the kept train items, so the data cursor contract of `Task` holds.
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from asyncrl.items import PromptItem
from asyncrl.tasks.base import LazyItems, encode_prompt, epoch_order, use_chat
from asyncrl.tasks.config import ReasoningGymTaskConfig, TaskConfig

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger(__name__)


def check_task(cfg: TaskConfig) -> str | None:
    """A config error for a reasoning-gym task whose dataset name is unknown (with close
    matches) or whose dataset config its config class rejects; None otherwise. Imports
    reasoning-gym (seconds), so roles call it at start-up, not the config loader."""
    if not isinstance(cfg, ReasoningGymTaskConfig):
        return None
    try:
        from reasoning_gym.factory import DATASETS
    except ImportError:
        return "task.type: reasoning_gym needs reasoning-gym: pip install 'asyncrl[gym]'"
    if cfg.name not in DATASETS:
        close = difflib.get_close_matches(cfg.name, DATASETS, n=3)
        hint = f"did you mean {', '.join(close)}?" if close else f"one of {len(DATASETS)} names"
        return f"task.name: unknown reasoning-gym dataset {cfg.name!r} ({hint})"
    config_cls = DATASETS[cfg.name][1]
    try:
        config = config_cls(**{**cfg.config, "seed": cfg.seed, "size": cfg.size})
        if hasattr(config, "validate"):
            config.validate()
    except (TypeError, ValueError, AssertionError) as exc:
        fields = dataclasses.fields(config_cls) if dataclasses.is_dataclass(config_cls) else ()
        keys = ", ".join(f.name for f in fields if f.name not in ("seed", "size"))
        return f"task.config: {exc or type(exc).__name__} ({cfg.name} takes {keys or '?'})"
    return None


def characters(cfg: ReasoningGymTaskConfig) -> str:
    """Every character of the task's questions and answers, in first-seen order: the vocabulary
    of a char-level model for it (`tools/make_tiny_model.py --random-for`)."""
    chars: dict[str, None] = {}
    for dataset in _datasets(cfg):
        for entry in dataset:
            chars.update(dict.fromkeys(f"{entry['question']}{entry['answer']}"))
    return "".join(chars)


def _datasets(cfg: ReasoningGymTaskConfig) -> tuple[Any, Any]:
    """The train and held-out generators."""
    import reasoning_gym

    eval_seed = cfg.seed + cfg.size if cfg.eval_seed is None else cfg.eval_seed
    train = reasoning_gym.create_dataset(
        cfg.name, **{**cfg.config, "seed": cfg.seed, "size": cfg.size}
    )
    held_out = reasoning_gym.create_dataset(
        cfg.name, **{**cfg.config, "seed": eval_seed, "size": cfg.eval_size}
    )
    return train, held_out


class ReasoningGymTask:
    """A reasoning-gym dataset's train and held-out splits (see the module docstring)."""

    def __init__(self, cfg: ReasoningGymTaskConfig, tokenizer: PreTrainedTokenizerBase) -> None:
        self._tokenizer = tokenizer
        self._chat = use_chat(tokenizer, cfg.chat_template)
        self._dataset, held_out = _datasets(cfg)
        self._eval = [(f"eval:{i}", entry) for i, entry in enumerate(held_out)]
        questions = {entry["question"] for _, entry in self._eval}
        train = [(f"train:{i}", e) for i, e in enumerate(self._dataset)]
        self._train = [(pid, e) for pid, e in train if e["question"] not in questions]
        self.removed = len(train) - len(self._train)
        """Train items dropped because their question is held out."""
        if self.removed:
            log.info("%s: %d train items removed, held out", cfg.name, self.removed)
        if not self._train:
            raise ValueError(f"task.size={cfg.size}: every train item of {cfg.name} is held out")
        self._entries = {pid: e for pid, e in (*self._train, *self._eval)}

    def train_items(self, seed: int, epoch: int) -> Sequence[PromptItem]:
        rows = self._train
        return LazyItems(lambda i: self._item(*rows[i]), epoch_order(len(rows), seed, epoch))

    def eval_items(self) -> Sequence[PromptItem]:
        rows = self._eval
        return LazyItems(lambda i: self._item(*rows[i]), np.arange(len(rows)))

    def score(self, item: PromptItem, response_text: str) -> float:
        from reasoning_gym.utils import extract_answer

        answer = extract_answer(response_text)
        entry = self._entries[item.prompt_id]
        return float(
            self._dataset.score_answer(response_text.strip() if answer is None else answer, entry)
        )

    def _item(self, prompt_id: str, entry: dict[str, Any]) -> PromptItem:
        question = entry["question"]
        ids = encode_prompt(self._tokenizer, question, self._chat)
        return PromptItem(prompt_id, question, ids, str(entry["answer"]))
