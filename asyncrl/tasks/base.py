"""Tasks: where prompts come from and how responses are scored (`asyncrl.tasks.build` picks
one by config `type`)."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, overload, runtime_checkable

import numpy as np

from asyncrl.environments.base import render_prompt
from asyncrl.items import PromptItem
from asyncrl.protocol import plain_value_problem
from asyncrl.tasks.config import ArithmeticTaskConfig, DatasetTaskConfig, PythonTaskConfig
from asyncrl.tasks.rewards import build_reward

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from asyncrl.environments.base import Environment, EnvironmentFactory

log = logging.getLogger(__name__)


class Task(Protocol):
    """A source of prompts and a scorer of responses.

    The train split is addressed by a data cursor (seed, epoch, position):
    `task.train_items(seed, epoch)[position]` is the same item in every process and after every
    restart, so a checkpoint stores three integers, not a sampler state. Each epoch is a fresh
    seeded permutation of the same items; the eval split is fixed and disjoint from train.
    """

    def train_items(self, seed: int, epoch: int) -> Sequence[PromptItem]:
        """The train split in the order of epoch `epoch` under `seed` (both ≥ 0)."""
        ...

    def eval_items(self) -> Sequence[PromptItem]:
        """The held-out split, in a fixed order."""
        ...

    def score(self, item: PromptItem, response_text: str) -> float:
        """Reward of a decoded response (special tokens removed)."""
        ...


@runtime_checkable
class EpisodicTask(Task, Protocol):
    """A task whose prompts start multi-turn episodes. A plain `Task` is the one-turn case:
    its response is scored with `score` and no environment is involved."""

    def environment(self, item: PromptItem, episode_id: str) -> Environment:
        """A fresh environment (`asyncrl.environments.base`) for one episode of `item`;
        `episode_id` is unique per episode and seeds anything random in it."""
        ...


class WithEnvironment:
    """A task whose episodes talk to the environment of `task.environment`: the task gives the
    items and scores a last turn the environment leaves unscored; the environment gives the
    turns, and may make the prompt (`prompt`: an item's token ids, in place of the task's; a
    tool environment puts its tools' schemas there). Anything else is the task's."""

    def __init__(
        self,
        task: Task,
        environments: EnvironmentFactory,
        prompt: Callable[[PromptItem], list[int]] | None = None,
    ) -> None:
        self._task = task
        self._environments = environments
        self._prompt = prompt

    def train_items(self, seed: int, epoch: int) -> Sequence[PromptItem]:
        return self._prompted(self._task.train_items(seed, epoch))

    def eval_items(self) -> Sequence[PromptItem]:
        return self._prompted(self._task.eval_items())

    def _prompted(self, items: Sequence[PromptItem]) -> Sequence[PromptItem]:
        prompt = self._prompt
        if prompt is None:
            return items
        return LazyItems(
            lambda i: replace(items[i], prompt_ids=prompt(items[i])), np.arange(len(items))
        )

    def score(self, item: PromptItem, response_text: str) -> float:
        return self._task.score(item, response_text)

    def environment(self, item: PromptItem, episode_id: str) -> Environment:
        return self._environments(item, episode_id)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._task, name)


class LazyItems(Sequence[PromptItem]):
    """Items built on access: position i is `make(order[i])`. Tokenising lazily keeps a large
    split cheap to hold and to re-permute every epoch."""

    def __init__(self, make: Callable[[int], PromptItem], order: np.ndarray) -> None:
        self._make = make
        self._order = order

    def __len__(self) -> int:
        return len(self._order)

    @overload
    def __getitem__(self, index: int) -> PromptItem: ...
    @overload
    def __getitem__(self, index: slice) -> list[PromptItem]: ...
    def __getitem__(self, index: int | slice) -> PromptItem | list[PromptItem]:
        if isinstance(index, slice):
            return [self._make(int(i)) for i in self._order[index]]
        return self._make(int(self._order[index]))


def epoch_order(n: int, seed: int, epoch: int) -> np.ndarray:
    """Positions of epoch `epoch` of an n-item split: a permutation fixed by (seed, epoch)."""
    return np.random.default_rng([seed, epoch]).permutation(n)


def use_chat(tokenizer: PreTrainedTokenizerBase, chat_template: bool | None) -> bool:
    """Whether prompts become chat turns: as configured, else when the tokenizer has a template."""
    if chat_template is None:
        return getattr(tokenizer, "chat_template", None) is not None
    return chat_template


def encode_prompt(tokenizer: PreTrainedTokenizerBase, prompt: str, chat: bool) -> list[int]:
    """Token ids of a prompt, as a user turn of the chat template (generation prompt added) when
    `chat`, else plainly (with the tokenizer's special tokens)."""
    if not chat:
        return list(tokenizer(prompt)["input_ids"])
    return render_prompt(tokenizer, [{"role": "user", "content": prompt}])


class ArithmeticTask:
    """`a+b=` with operands of exactly `digits` digits; the answer is the decimal sum.

    The pair space (e.g. 90 × 90 for 2 digits) is sampled once without replacement under
    `cfg.seed`: the first `eval_size` pairs are the eval split, the next `train_size` the train
    split, so the two never share a pair.
    """

    def __init__(self, cfg: ArithmeticTaskConfig, tokenizer: PreTrainedTokenizerBase) -> None:
        self._tokenizer = tokenizer
        self._reward = build_reward(cfg.reward)
        self._low = 0 if cfg.digits == 1 else 10 ** (cfg.digits - 1)
        self._span = 10**cfg.digits - self._low
        pairs = self._span**2  # more than eval_size: checked by the config
        drawn = np.random.default_rng(cfg.seed).choice(
            pairs, min(pairs, cfg.eval_size + cfg.train_size), replace=False
        )
        self._eval, self._train = drawn[: cfg.eval_size], drawn[cfg.eval_size :]

    def train_items(self, seed: int, epoch: int) -> Sequence[PromptItem]:
        return LazyItems(self._item, self.train_pairs(seed, epoch))

    def eval_items(self) -> Sequence[PromptItem]:
        return LazyItems(self._item, self._eval)

    def train_pairs(self, seed: int, epoch: int) -> np.ndarray:
        """The train split's pairs in the order of `epoch`."""
        return self._train[epoch_order(len(self._train), seed, epoch)]

    def eval_pairs(self) -> np.ndarray:
        return self._eval

    def question(self, pair: int) -> tuple[str, str]:
        """("a+b", "sum") of a pair."""
        a, b = (self._low + x for x in divmod(int(pair), self._span))
        return f"{a}+{b}", str(a + b)

    def score(self, item: PromptItem, response_text: str) -> float:
        return self._reward(response_text, item.answer)

    def _item(self, pair: int) -> PromptItem:
        question, answer = self.question(pair)
        prompt = f"{question}="
        ids = self._tokenizer(prompt)["input_ids"]
        return PromptItem(prompt_id=question, prompt=prompt, prompt_ids=ids, answer=answer)


class DatasetError(ValueError):
    """A dataset file or row that cannot be used; the message names the file and the row."""


Records = Iterable[tuple[int, str, object]]
"""(number, location, record) of each record of one split: (3, "line 3", ...) in a JSONL file,
(0, "row 0", ...) in a table; the number makes the item's id."""

Messages = list[dict[str, str]]


@dataclass(frozen=True)
class _Row:
    prompt_id: str
    prompt: str | Messages
    """Text, or chat messages."""
    answer: Any


class RecordsTask:
    """Prompts and answers from records: rows of a dataset, or a task factory's records.

    Records are validated when the task is built, so bad data fails at start-up, not hours into
    a run. `skipped` counts the records dropped per split under `skip_bad_rows`.
    """

    def __init__(
        self,
        cfg: DatasetTaskConfig | PythonTaskConfig,
        tokenizer: PreTrainedTokenizerBase,
        train: tuple[str, Records],
        evals: tuple[str, Records] | None,
    ) -> None:
        self._cfg = cfg
        self._tokenizer = tokenizer
        self._reward = build_reward(cfg.reward)
        self._has_template = getattr(tokenizer, "chat_template", None) is not None
        self._chat = use_chat(tokenizer, cfg.chat_template)
        self.skipped: dict[str, int] = {}
        self._train = self._load("train", *train)
        self._eval = [] if evals is None else self._load("eval", *evals)

    def train_items(self, seed: int, epoch: int) -> Sequence[PromptItem]:
        rows = self._train
        return LazyItems(lambda i: self._item(rows[i]), epoch_order(len(rows), seed, epoch))

    def eval_items(self) -> Sequence[PromptItem]:
        rows = self._eval
        return LazyItems(lambda i: self._item(rows[i]), np.arange(len(rows)))

    def score(self, item: PromptItem, response_text: str) -> float:
        return self._reward(response_text, item.answer)

    def _item(self, row: _Row) -> PromptItem:
        if isinstance(row.prompt, list):
            ids = render_prompt(self._tokenizer, row.prompt)
            last = row.prompt[-1]["content"]
            return PromptItem(row.prompt_id, last, ids, row.answer, messages=row.prompt)
        ids = encode_prompt(self._tokenizer, row.prompt, self._chat)
        return PromptItem(row.prompt_id, row.prompt, ids, row.answer)

    def _load(self, split: str, source: str, records: Records) -> list[_Row]:
        fields = (self._cfg.prompt_field, self._cfg.answer_field)
        rows: list[_Row] = []
        bad: list[str] = []
        for number, where, record in records:
            values = _check(record, fields)
            if isinstance(values, tuple) and isinstance(values[0], list) and not self._has_template:
                values = "chat messages need a tokenizer with a chat template"
            if isinstance(values, str):
                if not self._cfg.skip_bad_rows:
                    raise DatasetError(f"{source}: {where}: {values}")
                bad.append(f"{where}: {values}")
            else:
                rows.append(_Row(f"{split}:{number}", *values))
        self.skipped[split] = len(bad)
        if bad:
            log.warning("%s: skipped %d bad rows (first: %s)", source, len(bad), bad[0])
        if not rows:
            raise DatasetError(f"{source}: no usable rows ({len(bad)} bad)")
        return rows


class DatasetTask(RecordsTask):
    """Prompts and answers from JSONL or Parquet files, or saved Hugging Face datasets."""

    def __init__(self, cfg: DatasetTaskConfig, tokenizer: PreTrainedTokenizerBase) -> None:
        fields = (cfg.prompt_field, cfg.answer_field)
        train = (cfg.train_file, _records(Path(cfg.train_file), fields))
        evals = (
            None
            if cfg.eval_file is None
            else (cfg.eval_file, _records(Path(cfg.eval_file), fields))
        )
        super().__init__(cfg, tokenizer, train, evals)


@dataclass(frozen=True)
class _Unparsable:
    reason: str


def _records(path: Path, fields: tuple[str, ...]) -> Records:
    """Each row: "line N" in JSONL (from 1, blank lines skipped), "row N" in Parquet and saved
    datasets (from 0)."""
    if path.suffix == ".jsonl":
        with path.open(encoding="utf-8") as f:
            for number, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    yield number, f"line {number}", json.loads(line)
                except json.JSONDecodeError as e:
                    yield number, f"line {number}", _Unparsable(f"invalid JSON ({e.msg})")
    elif path.suffix == ".parquet":
        import pyarrow.parquet as pq

        present = set(pq.read_schema(path).names)
        table = pq.read_table(path, columns=[f for f in fields if f in present])
        for number, record in enumerate(table.to_pylist()):
            yield number, f"row {number}", record
    elif path.is_dir():
        for number, record in enumerate(_saved_dataset(path, fields)):
            yield number, f"row {number}", record
    else:
        raise DatasetError(
            f"{path}: unsupported file type; use .jsonl, .parquet or a saved dataset's directory"
        )


def _saved_dataset(path: Path, fields: tuple[str, ...]) -> Iterable[dict[str, Any]]:
    try:
        import datasets
    except ImportError:
        raise DatasetError(
            f"{path}: reading a saved dataset needs the `datasets` package "
            "(pip install 'asyncrl[data]')"
        ) from None
    try:
        loaded = datasets.load_from_disk(str(path))
    except FileNotFoundError as exc:
        raise DatasetError(f"{path}: not a saved dataset ({exc})") from None
    if isinstance(loaded, datasets.DatasetDict):
        splits = ", ".join(f"{path}/{name}" for name in loaded)
        raise DatasetError(f"{path}: holds several splits; name one: {splits}")
    present = [f for f in fields if f in loaded.column_names]
    return loaded.select_columns(present)


def _check(record: object, fields: tuple[str, str]) -> tuple[str | Messages, Any] | str:
    """The (prompt, answer) of a record, or why it is unusable."""
    if isinstance(record, _Unparsable):
        return record.reason
    if not isinstance(record, dict):
        return f"expected an object, got {type(record).__name__}"
    prompt_field, answer_field = fields
    prompt: Any = record.get(prompt_field)
    answer: Any = record.get(answer_field)
    for field, value in ((prompt_field, prompt), (answer_field, answer)):
        if value is None:
            return f"missing field {field!r}"
        # An empty list or map may be a true answer ("no solutions"); an empty text is not.
        if isinstance(value, str) and not value.strip():
            return f"field {field!r} is empty"
    if prompt == []:
        return f"field {prompt_field!r} is empty"
    if not isinstance(prompt, str) and not _is_messages(prompt):
        return (
            f"field {prompt_field!r} is {type(prompt).__name__}, expected a string or chat "
            "messages (a list of {role, content} strings)"
        )
    problem = plain_value_problem(answer)
    if problem is not None:
        return f"field {answer_field!r}: {problem}"
    return prompt, answer


def _is_messages(value: object) -> bool:
    return isinstance(value, list) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
        for m in value
    )
