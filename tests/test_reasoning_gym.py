"""reasoning-gym tasks: splits, the data cursor, scoring by the dataset's own code, the
unknown-name config error, and a run that learns one from random weights."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import reasoning_gym

from asyncrl.config import ConfigError, load_config
from asyncrl.tasks.build import build_task
from asyncrl.tasks.config import ReasoningGymTaskConfig
from asyncrl.tasks.gym import ReasoningGymTask, characters, check_task
from asyncrl.tiny_model import SPECIAL_TOKENS, build_tokenizer, save_random_tiny_model

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = REPO / "examples" / "reasoning_gym.yaml"
# Two 1-digit operands: 121 problems in all, so seeds repeat problems and removal must show.
SMALL = {"min_digits": 1, "max_digits": 1, "min_terms": 2, "max_terms": 2, "operators": ["+"]}
SMALL["allow_parentheses"] = False


ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}


def launch(role: str, *args: str) -> subprocess.CompletedProcess[str]:
    """`asyncrl launch --role ROLE --config examples/reasoning_gym.yaml ARGS`."""
    argv = [sys.executable, "-m", "asyncrl", "launch", "--role", role, "--config", str(EXAMPLE)]
    return subprocess.run(
        [*argv, *args], capture_output=True, text=True, env=ENV, timeout=800, cwd=REPO
    )


class CharTokenizer:
    """Any text, one id per character: the task's own code under test, not a vocabulary."""

    chat_template: str | None = None

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        return {"input_ids": [ord(c) for c in text]}

    def apply_chat_template(self, turns: list[dict[str, str]], **_: object) -> str:
        return "".join(f"<{t['role']}>{t['content']}</{t['role']}>" for t in turns) + "<bot>"


def _task(tokenizer: object = None, **cfg: object) -> ReasoningGymTask:
    settings = {"name": "basic_arithmetic", "config": SMALL, "size": 400, "eval_size": 50, **cfg}
    task = build_task(ReasoningGymTaskConfig(**settings), tokenizer or CharTokenizer())  # type: ignore[arg-type]
    assert isinstance(task, ReasoningGymTask)
    return task


def test_splits_are_deterministic_and_held_out_questions_never_train() -> None:
    a, b = _task(), _task()
    evals = list(a.eval_items())
    assert [i.prompt for i in evals] == [i.prompt for i in b.eval_items()]
    for seed, epoch in [(0, 0), (7, 3)]:
        assert list(a.train_items(seed, epoch)) == list(b.train_items(seed, epoch))
    train = a.train_items(0, 0)
    assert a.removed > 0 and len(train) == 400 - a.removed
    assert not {i.prompt for i in evals} & {i.prompt for i in train}
    # Each epoch permutes the same items; positions are stable within one.
    assert {i.prompt_id for i in train} == {i.prompt_id for i in a.train_items(0, 1)}
    assert [i.prompt_id for i in train[:20]] != [i.prompt_id for i in a.train_items(0, 1)[:20]]
    assert train[5] == train[5:6][0]


def test_held_out_seed_is_not_the_train_seed_shifted() -> None:
    """basic_arithmetic seeds item i with `seed + i`: a held-out split from `seed + 1` would be
    the train split shifted by one, which the default `seed + size` avoids."""
    big = {**SMALL, "min_digits": 3, "max_digits": 3}
    task = _task(config=big, size=300, eval_size=100)
    assert task.removed == 0
    shifted = _task(config=big, size=300, eval_size=100, eval_seed=1)
    assert shifted.removed == 100


def test_items_and_scores_come_from_reasoning_gym() -> None:
    task = _task()
    entry = reasoning_gym.create_dataset("basic_arithmetic", seed=400, size=50, **SMALL)[0]
    item = task.eval_items()[0]
    assert item.prompt == entry["question"] and item.answer == entry["answer"]
    assert item.prompt_ids == [ord(c) for c in entry["question"]]
    answer = entry["answer"]
    assert task.score(item, f" {answer}\n") == 1.0  # no tag: the whole response
    assert (
        task.score(item, f"think <answer>9{answer}9</answer> then <answer>{answer}</answer>") == 1.0
    )
    assert task.score(item, f"<answer>{answer}</answer> but <answer>x</answer>") == 0.0
    # score_answer's own partial credit: the answer inside a longer one.
    assert task.score(item, f"<answer>{answer}xx</answer>") == pytest.approx(
        len(answer) / (len(answer) + 2)
    )


def test_chat_template_when_the_tokenizer_has_one() -> None:
    chat = CharTokenizer()
    chat.chat_template = "{{ messages }}"
    item = _task(chat).eval_items()[0]
    assert item.prompt_ids == [ord(c) for c in f"<user>{item.prompt}</user><bot>"]
    plain = _task(chat, chat_template=False).eval_items()[0]
    assert plain.prompt_ids == [ord(c) for c in item.prompt]


def test_a_random_model_for_the_task_encodes_its_text(tmp_path: Path) -> None:
    cfg = load_config(EXAMPLE).task
    assert isinstance(cfg, ReasoningGymTaskConfig)
    chars = characters(cfg)
    tokenizer = build_tokenizer((*SPECIAL_TOKENS, *chars))
    item = build_task(cfg, tokenizer).eval_items()[0]
    assert tokenizer.decode(item.prompt_ids, skip_special_tokens=True) == item.prompt
    out = save_random_tiny_model(tmp_path / "m", chars=chars)
    assert json.loads((out / "config.json").read_text())["vocab_size"] == 3 + len(chars)


def test_unknown_dataset_names_close_matches() -> None:
    problem = check_task(ReasoningGymTaskConfig(name="basic_arithmetc"))
    assert problem is not None and problem.startswith("task.name: ")
    assert "basic_arithmetic" in problem
    assert check_task(ReasoningGymTaskConfig(name="gcd")) is None


@pytest.mark.parametrize(
    ("config", "says"),
    [
        ({"min_valu": 1}, "unexpected keyword argument 'min_valu'"),
        ({"min_value": 50, "max_value": 10}, "max_value must be > min_value"),
    ],
)
def test_the_datasets_own_config_is_checked(config: dict[str, object], says: str) -> None:
    problem = check_task(ReasoningGymTaskConfig(name="gcd", config=config))
    assert problem is not None and problem.startswith("task.config: ") and says in problem
    assert problem.endswith("(gcd takes min_numbers, max_numbers, min_value, max_value)")


def test_split_keys_belong_to_the_task_not_the_dataset_config() -> None:
    with pytest.raises(ConfigError, match=r"task\.config: seed: set task\.seed"):
        load_config(EXAMPLE, ["task.config.seed=3"])


@pytest.mark.parametrize("role", ["trainer", "all"])
def test_unknown_dataset_is_a_config_error_before_redis(role: str, tmp_path: Path) -> None:
    model = save_random_tiny_model(tmp_path / "model")
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        url = (
            [] if role == "all" else [f"redis.url=redis://127.0.0.1:{listener.getsockname()[1]}/0"]
        )
        proc = launch(
            role, f"run.dir={tmp_path / 'run'}", f"model.path={model}", "task.name=gdc", *url
        )
        assert proc.returncode == 2, proc.stderr
        lines = proc.stderr.strip().splitlines()
        assert lines == [
            "asyncrl: config error: task.name: unknown reasoning-gym dataset 'gdc' "
            "(did you mean gcd?)"
        ], proc.stderr
        listener.setblocking(False)
        with pytest.raises(BlockingIOError):
            listener.accept()  # nobody connected
    assert not (tmp_path / "run" / "redis").exists()


def test_config_loading_imports_neither_outside_library() -> None:
    """reasoning-gym takes seconds to import: only a role that builds the task pays for it."""
    code = (
        "import sys; from asyncrl.config import load_config\n"
        f"load_config({str(EXAMPLE)!r})\n"
        "print([m for m in ('reasoning_gym', 'math_verify') if m in sys.modules])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "[]", out.stderr


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_example_learns_gcd_from_random_weights(tmp_path: Path) -> None:
    """examples/reasoning_gym.yaml end to end: a random char-level model learns the GCD task's
    answers (their form, then which GCDs are likely) and held-out reward rises well above its
    first evaluation."""
    model = tmp_path / "model"
    tool = [sys.executable, str(REPO / "tools" / "make_tiny_model.py"), "--out", str(model)]
    subprocess.run([*tool, "--random-for", str(EXAMPLE)], check=True, env=ENV, timeout=120)
    run_dir = tmp_path / "run"
    start = time.monotonic()
    proc = launch(
        "all", "--progress", "quiet", "--fresh", f"run.dir={run_dir}", f"model.path={model}"
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = [r["eval_accuracy"] for r in records if "eval_accuracy" in r]
    assert len(evals) == 80 // 5, evals
    first, last = evals[0], sum(evals[-3:]) / 3
    assert last >= first + 0.07 and last >= 0.12, evals
    print(f"wall {time.monotonic() - start:.0f}s, held-out reward {evals}")
