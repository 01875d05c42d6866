"""`task.type: dataset` on every source it reads — JSONL, Parquet, a Hugging Face dataset saved
to disk — with string prompts or chat messages and answers of any plain type; bad rows named by
file and line (row for tables), skipped or refused as configured."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from asyncrl.tasks.base import DatasetError, DatasetTask
from asyncrl.tasks.config import DatasetTaskConfig
from asyncrl.tiny_model import build_tokenizer

ROWS: list[dict[str, Any]] = [
    {"prompt": "1+2=", "answer": 3},
    {"prompt": "2+2=", "answer": [4, "four"]},
    {"prompt": "3+4=", "answer": {"value": 7, "unit": None}},
    {"prompt": "5+5=", "answer": "10"},
]
CHAT = [
    {
        "messages": [
            {"role": "system", "content": "9"},
            {"role": "user", "content": "1+2="},
        ],
        "answer": 3,
    },
    {"messages": [{"role": "user", "content": "2+3="}], "answer": 5},
]
TEMPLATE = (
    "{% for m in messages %}{{ m['content'] }}={% endfor %}"
    "{% if add_generation_prompt %}+{% endif %}"
)


def _task(path: Path, tokenizer: Any = None, **cfg: Any) -> DatasetTask:
    config = DatasetTaskConfig(train_file=str(path), reward={"type": "exact"}, **cfg)
    return DatasetTask(config, tokenizer or build_tokenizer())


def _answers(task: DatasetTask) -> dict[str, Any]:
    return {item.prompt: item.answer for item in task.train_items(0, 0)}


def _jsonl(path: Path, rows: list[Any]) -> Path:
    path.write_text("".join(r if isinstance(r, str) else json.dumps(r) + "\n" for r in rows))
    return path


def _parquet(path: Path, rows: list[dict[str, Any]]) -> Path:
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def _saved(path: Path, rows: list[dict[str, Any]]) -> Path:
    datasets.Dataset.from_list(rows).save_to_disk(str(path))
    return path


EXPECTED = {r["prompt"]: r["answer"] for r in ROWS}


def test_jsonl_answers_of_any_plain_type_reach_the_reward_as_stored(tmp_path: Path) -> None:
    task = _task(_jsonl(tmp_path / "train.jsonl", ROWS))
    assert _answers(task) == EXPECTED
    (item,) = [i for i in task.train_items(0, 0) if i.prompt == "1+2="]
    assert item.answer == 3 and isinstance(item.answer, int)
    assert task.score(item, "3") == 1.0  # the exact reward compares with str(answer)


def test_parquet_and_saved_dataset_read_like_jsonl(tmp_path: Path) -> None:
    # Columns of one type each, as tables hold them.
    rows = [{"prompt": r["prompt"], "answer": n} for r, n in zip(ROWS, [3, 4, 7, 10], strict=True)]
    for path in (_parquet(tmp_path / "t.parquet", rows), _saved(tmp_path / "saved", rows)):
        task = _task(path)
        assert _answers(task) == {r["prompt"]: r["answer"] for r in rows}
        assert sorted(i.prompt_id for i in task.train_items(0, 0)) == [
            "train:0",
            "train:1",
            "train:2",
            "train:3",
        ]


def test_saved_dataset_dict_names_its_split_directories(tmp_path: Path) -> None:
    rows = [{"prompt": "1+2=", "answer": "3"}]
    splits = datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(rows), "test": datasets.Dataset.from_list(rows)}
    )
    splits.save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(DatasetError, match=f"{tmp_path / 'dd'}: holds several splits; name one"):
        _task(tmp_path / "dd")
    task = _task(tmp_path / "dd" / "train", eval_file=str(tmp_path / "dd" / "test"))
    assert [i.prompt for i in task.eval_items()] == ["1+2="]


def test_chat_messages_are_rendered_with_the_chat_template(tmp_path: Path) -> None:
    tokenizer = build_tokenizer()
    tokenizer.chat_template = TEMPLATE
    for path in (_jsonl(tmp_path / "chat.jsonl", CHAT), _saved(tmp_path / "chat", CHAT)):
        task = _task(path, tokenizer, prompt_field="messages")
        items = {i.prompt: i for i in task.train_items(0, 0)}
        first = items["1+2="]
        # The whole conversation is templated; the item's text is its last message.
        assert first.prompt == "1+2="
        assert first.prompt_ids == tokenizer("9=1+2==+", add_special_tokens=False)["input_ids"]
        assert first.answer == 3
        assert (
            items["2+3="].prompt_ids == tokenizer("2+3==+", add_special_tokens=False)["input_ids"]
        )


def test_chat_messages_without_a_chat_template_are_refused(tmp_path: Path) -> None:
    path = _jsonl(tmp_path / "chat.jsonl", CHAT)
    with pytest.raises(DatasetError, match=f"{path}: line 1: chat messages need a tokenizer"):
        _task(path, prompt_field="messages")


@pytest.mark.parametrize(
    ("row", "message"),
    [
        (
            {"messages": [{"role": "user"}], "answer": "3"},
            "line 2: field 'messages' is list, expected",
        ),
        ({"messages": [], "answer": "3"}, "line 2: field 'messages' is empty"),
        ({"messages": "1+2=", "answer": None}, "line 2: missing field 'answer'"),
        ({"messages": "1+2=", "answer": ""}, "line 2: field 'answer' is empty"),
    ],
)
def test_bad_chat_rows_name_file_and_line(tmp_path: Path, row: Any, message: str) -> None:
    tokenizer = build_tokenizer()
    tokenizer.chat_template = TEMPLATE
    path = _jsonl(tmp_path / "chat.jsonl", [CHAT[0], row, CHAT[1]])
    with pytest.raises(DatasetError, match=f"{path}: {message}"):
        _task(path, tokenizer, prompt_field="messages")
    skipping = _task(path, tokenizer, prompt_field="messages", skip_bad_rows=True)
    assert skipping.skipped == {"train": 1}
    assert len(skipping.train_items(0, 0)) == 2


def test_bad_rows_of_tables_are_named_by_row(tmp_path: Path) -> None:
    rows = [{"prompt": "1+2=", "answer": "3"}, {"prompt": None, "answer": "4"}]
    for path in (_parquet(tmp_path / "t.parquet", rows), _saved(tmp_path / "saved", rows)):
        with pytest.raises(DatasetError, match=f"{path}: row 1: missing field 'prompt'"):
            _task(path)
        assert _task(path, skip_bad_rows=True).skipped == {"train": 1}


def test_missing_saved_dataset_is_a_dataset_error(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(DatasetError, match=f"{tmp_path / 'empty'}: not a saved dataset"):
        _task(tmp_path / "empty")
