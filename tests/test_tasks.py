import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from pydantic import TypeAdapter, ValidationError

from asyncrl.tasks.base import ArithmeticTask, DatasetError, DatasetTask
from asyncrl.tasks.build import build_task
from asyncrl.tasks.config import ArithmeticTaskConfig, DatasetTaskConfig, TaskConfig
from asyncrl.tiny_model import BOS_ID, build_tokenizer

TOKENIZER = build_tokenizer()


def _arithmetic(**cfg: object) -> ArithmeticTask:
    task = build_task(ArithmeticTaskConfig(**cfg), TOKENIZER)  # type: ignore[arg-type]
    assert isinstance(task, ArithmeticTask)
    return task


def test_arithmetic_splits_are_deterministic_disjoint_and_complete() -> None:
    a, b = _arithmetic(), _arithmetic()
    eval_ids = [item.prompt_id for item in a.eval_items()]
    assert eval_ids == [item.prompt_id for item in b.eval_items()]
    train = a.train_items(seed=7, epoch=0)
    assert [i.prompt_id for i in train] == [i.prompt_id for i in b.train_items(seed=7, epoch=0)]
    assert len(eval_ids) == len(set(eval_ids)) == 500
    assert len(train) == 90 * 90 - 500  # 2 digits: every pair not held out
    assert not set(eval_ids) & {item.prompt_id for item in train}


def test_arithmetic_epochs_permute_the_same_items() -> None:
    task = _arithmetic()
    first, second = task.train_items(0, 0), task.train_items(0, 1)
    assert [i.prompt_id for i in first[:20]] != [i.prompt_id for i in second[:20]]
    assert {i.prompt_id for i in first} == {i.prompt_id for i in second}
    assert first[5] == first[5:6][0] and first[-1] == first[len(first) - 1]


def test_arithmetic_items_and_score() -> None:
    task = _arithmetic(digits=3, train_size=50, eval_size=20)
    for item in [*task.eval_items(), *task.train_items(0, 0)]:
        a, b = map(int, item.prompt.removesuffix("=").split("+"))
        assert 100 <= a <= 999 and 100 <= b <= 999
        assert item.prompt == f"{item.prompt_id}=" and item.answer == str(a + b)
        assert item.prompt_ids == [
            BOS_ID,
            *TOKENIZER(item.prompt, add_special_tokens=False)["input_ids"],
        ]
        assert task.score(item, f" {a + b} ") == 1.0
        assert task.score(item, str(a + b + 1)) == 0.0
    assert len(task.train_items(0, 0)) == 50


def test_arithmetic_one_digit_includes_zero_and_rejects_oversized_eval() -> None:
    task = _arithmetic(digits=1, eval_size=10)
    ids = {i.prompt_id for i in [*task.eval_items(), *task.train_items(0, 0)]}
    assert len(ids) == 100 and "0+0" in ids
    with pytest.raises(ValueError, match=r"task\.eval_size=100"):
        _arithmetic(digits=1, eval_size=100)


def test_task_config_union_names_allowed_types() -> None:
    adapter: TypeAdapter[TaskConfig] = TypeAdapter(TaskConfig)
    assert isinstance(adapter.validate_python({"type": "arithmetic"}), ArithmeticTaskConfig)
    with pytest.raises(ValidationError, match="'arithmetic', 'dataset'"):
        adapter.validate_python({"type": "gsm8k"})


def _jsonl(path: Path, rows: list[object]) -> Path:
    path.write_text("".join(r if isinstance(r, str) else json.dumps(r) + "\n" for r in rows))
    return path


def _dataset(train: Path, **cfg: object) -> DatasetTask:
    task = build_task(DatasetTaskConfig(train_file=str(train), **cfg), TOKENIZER)  # type: ignore[arg-type]
    assert isinstance(task, DatasetTask)
    return task


GOOD = [{"prompt": "1+2=", "answer": "3"}, {"prompt": "20+2=", "answer": "22", "extra": 1}]


def test_jsonl_and_parquet_load_the_same_items(tmp_path: Path) -> None:
    jsonl = _jsonl(tmp_path / "train.jsonl", [GOOD[0], "\n", GOOD[1]])
    parquet = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(GOOD), parquet)
    from_jsonl = list(_dataset(jsonl).train_items(0, 0))
    from_parquet = list(_dataset(parquet).train_items(0, 0))
    assert {(i.prompt, i.answer) for i in from_jsonl} == {("1+2=", "3"), ("20+2=", "22")}
    assert sorted((i.prompt, i.prompt_ids, i.answer) for i in from_jsonl) == sorted(
        (i.prompt, i.prompt_ids, i.answer) for i in from_parquet
    )
    assert sorted(i.prompt_id for i in from_jsonl) == ["train:1", "train:3"]  # line numbers
    assert sorted(i.prompt_id for i in from_parquet) == ["train:0", "train:1"]  # row indices


def test_eval_file_and_default_math_reward(tmp_path: Path) -> None:
    train = _jsonl(tmp_path / "train.jsonl", GOOD)
    evals = _jsonl(tmp_path / "eval.jsonl", [{"prompt": "5+5=", "answer": "10"}])
    task = _dataset(train, eval_file=str(evals))
    (item,) = task.eval_items()
    assert item.prompt_id == "eval:1" and item.prompt_ids == TOKENIZER("5+5=")["input_ids"]
    assert task.score(item, "so the answer is \\boxed{10}") == 1.0
    assert task.score(item, "10") == 1.0  # math-verify reads an unmarked answer too
    assert task.score(item, "\\boxed{11}") == 0.0
    assert list(_dataset(train).eval_items()) == []


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ({"answer": "3"}, "line 2: missing field 'prompt'"),
        ({"prompt": 3, "answer": "3"}, "line 2: field 'prompt' is int, expected a string or chat"),
        ({"prompt": "  ", "answer": "3"}, "line 2: field 'prompt' is empty"),
        ("{not json\n", "line 2: invalid JSON"),
        ([1, 2], "line 2: expected an object, got list"),
    ],
)
def test_bad_jsonl_row_names_file_and_line(tmp_path: Path, row: object, message: str) -> None:
    path = _jsonl(tmp_path / "train.jsonl", [GOOD[0], row, GOOD[1]])
    with pytest.raises(DatasetError, match=f"{path}: {message}"):
        _dataset(path)


def test_bad_parquet_row_names_file_and_row(tmp_path: Path) -> None:
    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist([*GOOD, {"prompt": None, "answer": "1"}]), path)
    with pytest.raises(DatasetError, match=f"{path}: row 2: missing field 'prompt'"):
        _dataset(path)
    no_answer = tmp_path / "no_answer.parquet"
    pq.write_table(pa.Table.from_pylist([{"prompt": "1+2="}]), no_answer)
    with pytest.raises(DatasetError, match=f"{no_answer}: row 0: missing field 'answer'"):
        _dataset(no_answer)


def test_skip_bad_rows_counts_them(tmp_path: Path) -> None:
    train = _jsonl(tmp_path / "train.jsonl", [GOOD[0], {"prompt": ""}, "oops\n", GOOD[1]])
    evals = _jsonl(tmp_path / "eval.jsonl", [GOOD[0]])
    task = _dataset(train, eval_file=str(evals), skip_bad_rows=True)
    assert task.skipped == {"train": 2, "eval": 0}
    assert len(task.train_items(0, 0)) == 2


def test_file_without_usable_rows_or_format_fails(tmp_path: Path) -> None:
    bad = _jsonl(tmp_path / "train.jsonl", [{"prompt": ""}])
    with pytest.raises(DatasetError, match=f"{bad}: no usable rows \\(1 bad\\)"):
        _dataset(bad, skip_bad_rows=True)
    csv = tmp_path / "train.csv"
    csv.write_text("prompt,answer\n")
    with pytest.raises(DatasetError, match="unsupported file type"):
        _dataset(csv)


def test_custom_fields_and_chat_template(tmp_path: Path) -> None:
    path = _jsonl(tmp_path / "train.jsonl", [{"q": "1+2=", "a": "3"}])
    tokenizer = build_tokenizer()
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}+"
    cfg = DatasetTaskConfig(train_file=str(path), prompt_field="q", answer_field="a")
    (templated,) = DatasetTask(cfg, tokenizer).train_items(0, 0)
    # The template is applied and its text tokenised without adding <bos> a second time.
    assert templated.prompt == "1+2="
    assert templated.prompt_ids == tokenizer("1+2=+", add_special_tokens=False)["input_ids"]
    plain_cfg = cfg.model_copy(update={"chat_template": False})
    (plain,) = DatasetTask(plain_cfg, tokenizer).train_items(0, 0)
    assert plain.prompt_ids == tokenizer("1+2=")["input_ids"]
