"""Plugins by import path: user modules written outside the repo, loaded by config only. A bad
path is a one-line config error naming the key (exit 2); a reward that raises, hangs, returns
no finite number or kills its process is a `RewardFailure` with a stable reason, and the next
call works; non-string answers cross the prompts stream as they are."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from asyncrl.config import ConfigError, load_config
from asyncrl.plugins import load_object
from asyncrl.protocol import PromptGroup, ValidationError, decode_prompt, encode_prompt
from asyncrl.tasks.base import RecordsTask
from asyncrl.tasks.build import build_task
from asyncrl.tasks.config import PythonRewardConfig, PythonTaskConfig
from asyncrl.tasks.isolated import IsolatedReward, RewardFailure
from asyncrl.tiny_model import build_tokenizer

REPO = Path(__file__).resolve().parent.parent

USER_MODULE = """
import asyncio, math, os, subprocess, sys, time

def exact(response, answer, *, bonus=0.0):
    return float(response.strip() == str(answer)) + bonus

async def exact_async(response, answer):
    await asyncio.sleep(0.01)
    return 1.0 if response == str(answer) else 0.0

def takes_any(response, answer, **kwargs):
    return 0.0

def boom(response, answer):
    raise KeyError("no such thing")

def hang(response, answer):
    if response == "hang":
        time.sleep(3600)
    return 0.5

def nan(response, answer):
    return math.nan

def text(response, answer):
    return "1.0"

def numpy_and_bool(response, answer):
    import numpy
    return numpy.float32(0.25) if response else True

def die(response, answer):
    os._exit(3)

def pid(response, answer):
    return float(os.getpid())

def forks(response, answer, *, pidfile):
    if response == "fork":  # a helper that outlives the call, as a sandbox's might
        helper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
        with open(pidfile, "w") as f:
            f.write(str(helper.pid))
        return 0.0
    time.sleep(3600)

def no_answer(response):
    return 0.0

def records(*, n, tokenizer=None):
    return {"train": [{"prompt": f"{i}+1=", "answer": i + 1} for i in range(n)],
            "eval": [{"prompt": "0+0=", "answer": {"sum": 0}}]}

class Whole:
    def train_items(self, seed, epoch): return []
    def eval_items(self): return []
    def score(self, item, response_text): return 0.0

def whole(tokenizer):
    assert tokenizer is not None
    return Whole()

def wrong_kind():
    return [1, 2, 3]
"""


@pytest.fixture(scope="module")
def plugin_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A user package outside the repo (and off sys.path): only `python_path` finds it."""
    root = tmp_path_factory.mktemp("user_code")
    (root / "userpkg").mkdir()
    (root / "userpkg" / "__init__.py").write_text("")
    (root / "userpkg" / "funcs.py").write_text(textwrap.dedent(USER_MODULE))
    assert not str(root).startswith(str(REPO))
    return root


def _reward(
    plugin_dir: Path, name: str, timeout_s: float = 5.0, **kwargs: object
) -> IsolatedReward:
    cfg = PythonRewardConfig(
        path=f"userpkg.funcs:{name}",
        python_path=[str(plugin_dir)],
        kwargs=kwargs,
        timeout_s=timeout_s,
    )
    return IsolatedReward(cfg.path, cfg.python_path, cfg.kwargs, cfg.timeout_s)


def test_sync_and_async_rewards_get_answer_and_kwargs(plugin_dir: Path) -> None:
    exact = _reward(plugin_dir, "exact", bonus=0.5)
    assert exact("46 ", 46) == 1.5
    assert exact("45", 46) == 0.5
    async_reward = _reward(plugin_dir, "exact_async")
    assert async_reward("[1, 2]", [1, 2]) == 1.0
    assert async_reward("x", "y") == 0.0
    assert _reward(plugin_dir, "numpy_and_bool")("a", None) == 0.25
    assert _reward(plugin_dir, "numpy_and_bool")("", None) == 1.0


@pytest.mark.parametrize(
    ("name", "reason", "detail"),
    [
        ("boom", "reward_error", "KeyError: 'no such thing'"),
        ("nan", "reward_invalid", "returned nan, not finite"),
        ("text", "reward_invalid", "returned str '1.0', not a number"),
        ("die", "reward_error", "reward process exited (3)"),
    ],
)
def test_failing_reward_has_its_reason_and_the_next_call_works(
    plugin_dir: Path, name: str, reason: str, detail: str
) -> None:
    reward = _reward(plugin_dir, name)
    for _ in range(2):  # a dead process is replaced by the next call
        with pytest.raises(RewardFailure) as failure:
            reward("1", 1)
        assert failure.value.reason == reason
        assert detail in failure.value.detail


def test_hung_reward_times_out_its_process_is_killed_and_replaced(plugin_dir: Path) -> None:
    reward = _reward(plugin_dir, "hang", timeout_s=0.5)
    assert reward("fine", 0) == 0.5
    hung_pid = reward.pid
    t0 = time.monotonic()
    with pytest.raises(RewardFailure) as failure:
        reward("hang", 0)
    assert failure.value.reason == "reward_timeout"
    assert 0.5 <= time.monotonic() - t0 < 30  # timed out, not hung
    # The hung call's process is gone (nothing leaks), and a fresh one serves the next call.
    assert not Path(f"/proc/{hung_pid}").exists()
    assert reward("fine", 0) == 0.5
    assert reward.pid not in (None, hung_pid)


def test_a_timed_out_reward_takes_the_helpers_it_forked_with_it(
    plugin_dir: Path, tmp_path: Path
) -> None:
    from role_procs import is_running, wait_until

    pidfile = tmp_path / "helper.pid"
    reward = _reward(plugin_dir, "forks", timeout_s=0.5, pidfile=str(pidfile))
    assert reward("fork", 0) == 0.0
    helper = int(pidfile.read_text())
    assert is_running(helper)
    with pytest.raises(RewardFailure, match="reward_timeout"):
        reward("hang", 0)
    wait_until(lambda: not is_running(helper), 30, "the reward's helper killed with it")


def test_reward_runs_outside_the_calling_process(plugin_dir: Path) -> None:
    assert _reward(plugin_dir, "pid")("", "") != os.getpid()


def test_python_task_wraps_records_with_non_string_answers(plugin_dir: Path) -> None:
    cfg = PythonTaskConfig(
        path="userpkg.funcs:records", python_path=[str(plugin_dir)], kwargs={"n": 3}
    )
    task = build_task(cfg, build_tokenizer())
    assert isinstance(task, RecordsTask)
    items = sorted(task.train_items(0, 0), key=lambda i: i.prompt_id)
    assert [(i.prompt_id, i.prompt, i.answer) for i in items] == [
        ("train:0", "0+1=", 1),
        ("train:1", "1+1=", 2),
        ("train:2", "2+1=", 3),
    ]
    (held_out,) = task.eval_items()
    assert held_out.answer == {"sum": 0}
    assert task.score(items[0], "1") == 1.0  # the default exact reward compares str(answer)


def test_python_task_may_return_a_whole_task_and_gets_the_tokenizer(plugin_dir: Path) -> None:
    cfg = PythonTaskConfig(path="userpkg.funcs:whole", python_path=[str(plugin_dir)])
    task = build_task(cfg, build_tokenizer())
    assert type(task).__name__ == "Whole"
    wrong = PythonTaskConfig(path="userpkg.funcs:wrong_kind", python_path=[str(plugin_dir)])
    with pytest.raises(ValueError, match="returned list; expected a Task"):
        build_task(wrong, build_tokenizer())


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (
            "task.reward.path=userpkg.funcs:missing",
            "task.reward.path: module 'userpkg.funcs' has no attribute 'missing'",
        ),
        (
            "task.reward.path=userpkg.nowhere:exact",
            "task.reward.path: cannot import 'userpkg.nowhere': ModuleNotFoundError",
        ),
        (
            "task.reward.path=userpkg.funcs.exact",
            "task.reward.path: 'userpkg.funcs.exact': expected 'package.module:function'",
        ),
        (
            "task.reward.path=userpkg.funcs:no_answer",
            "task.reward.path: cannot be called as fn(response, answer)",
        ),
        (
            "task.reward.kwargs.nope=1",
            "task.reward.path: cannot be called as fn(response, answer, nope=...): got an "
            "unexpected keyword argument 'nope'",
        ),
    ],
)
def test_bad_reward_path_is_one_config_line(plugin_dir: Path, override: str, message: str) -> None:
    base = [
        "task.type=arithmetic",
        f"task.reward.python_path=[{plugin_dir}]",
        "task.reward.type=python",
        "task.reward.path=userpkg.funcs:exact",
    ]
    assert load_config(None, base).task.reward.type == "python"  # type: ignore[union-attr]
    with pytest.raises(ConfigError) as err:
        load_config(None, [*base, override])
    assert str(err.value).startswith(message), err.value
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("2024-01-01", "'when' (date) cannot be sent to the reward's process"),
        ("!!set {a: null}", "'when' (set) cannot be sent to the reward's process"),
        ("36893488147419103232", "'when' (int) cannot be sent to the reward's process"),
        ("{1: a}", "'when' (dict) cannot be sent to the reward's process"),
    ],
)
def test_reward_kwargs_msgpack_cannot_carry_exit_2_with_one_line(
    plugin_dir: Path, value: str, message: str
) -> None:
    """YAML makes them, the reward's process could not be sent them: refused before anything
    starts, not a traceback when the role builds its reward."""
    proc = _print_config(
        plugin_dir,
        "task.type=arithmetic",
        f"task.reward.python_path=[{plugin_dir}]",
        "task.reward.type=python",
        "task.reward.path=userpkg.funcs:takes_any",
        f"task.reward.kwargs.when={value}",
        "model.build_tiny=false",
    )
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"asyncrl: config error: task.reward.kwargs: {message}"), lines


def _print_config(cwd: Path, *overrides: str) -> subprocess.CompletedProcess[str]:
    """`asyncrl launch --print-config` run in `cwd`, as a user starts it there."""
    return subprocess.run(
        [sys.executable, "-m", "asyncrl", "launch", "--role", "all", "--print-config", *overrides],
        cwd=cwd,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.parametrize(
    ("path", "message"),
    [
        ("userpkg.funcs:records", "task.path: cannot be called as factory(tokenizer=...): missing"),
        ("userpkg.funcs:nope", "task.path: module 'userpkg.funcs' has no attribute 'nope'"),
        ("nopkg:make", "task.path: cannot import 'nopkg'"),
    ],
)
def test_bad_task_path_exits_2_with_one_line(plugin_dir: Path, path: str, message: str) -> None:
    """Through the CLI, as a user meets it: one line, no traceback, before anything starts."""
    proc = _print_config(
        plugin_dir,
        "task.type=python",
        f"task.python_path=[{plugin_dir}]",
        f"task.path={path}",
        "model.build_tiny=false",
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"asyncrl: config error: {message}"), lines


def test_working_directory_is_on_the_import_path(plugin_dir: Path) -> None:
    """`python_path` left out: a module beside where asyncrl is started is found."""
    proc = _print_config(
        plugin_dir,
        "task.type=arithmetic",
        "task.reward.type=python",
        "task.reward.path=userpkg.funcs:exact",
    )
    assert proc.returncode == 0, proc.stderr
    assert "path: userpkg.funcs:exact" in proc.stdout


@pytest.mark.parametrize("answer", [46, 2.5, True, None, [1, "x"], {"sum": 46, "steps": [1, 2]}])
def test_plain_answers_cross_the_prompts_stream_unchanged(answer: object) -> None:
    group = PromptGroup(
        run="r",
        prompt_id="p",
        prompt="1+2=",
        prompt_ids=np.array([1, 2], np.int32),
        answer=answer,
        task="python",
        n=2,
        release_version=0,
    )
    assert decode_prompt(encode_prompt(group)).answer == answer


def test_a_broken_json_answer_is_a_malformed_prompt() -> None:
    group = PromptGroup(
        run="r",
        prompt_id="p",
        prompt="1+2=",
        prompt_ids=np.array([1], np.int32),
        answer=[1],
        task="python",
        n=2,
        release_version=0,
    )
    data = encode_prompt(group).replace(b"[1]", b"[1,")
    with pytest.raises(ValidationError) as err:
        decode_prompt(data)
    assert err.value.reason == "malformed"


def test_example_reward_scores_through_its_config(monkeypatch: pytest.MonkeyPatch) -> None:
    from asyncrl.tasks.rewards import build_reward

    monkeypatch.chdir(REPO)
    cfg = load_config(REPO / "examples" / "custom_reward" / "config.yaml")
    reward = build_reward(cfg.task.reward)
    assert reward(" 46", "46") == 1.0
    assert reward("45", "46") == 0.1  # partial_credit from the config's kwargs
    assert reward("4", "46") == 0.0


@pytest.mark.parametrize("task_type", ["arithmetic", "agentic"])
@pytest.mark.parametrize(("name", "reason"), [("boom", "reward_error"), ("nan", "reward_invalid")])
def test_scheduler_fails_the_group_with_the_rewards_reason(
    plugin_dir: Path, task_type: str, name: str, reason: str
) -> None:
    """Scored inline (one-turn tasks) or inside an environment step (agentic): the group's
    reason is the reward's, not `task_error` or `env_error`."""
    from episode_helpers import answering_one, run_until_failed

    tok = build_tokenizer()
    cfg = load_config(
        None,
        [
            f"task.type={task_type}",
            "task.eval_size=1",
            "task.train_size=1",
            *(["task.turns=2", "task.tool_latency_median_s=0"] if task_type == "agentic" else []),
            "task.reward.type=python",
            f"task.reward.python_path=[{plugin_dir}]",
            f"task.reward.path=userpkg.funcs:{name}",
        ],
    )
    task = build_task(cfg.task, tok)
    sched = answering_one(task, tok)
    sched.start("g", task.train_items(0, 0)[0], 2, "g")
    failed = run_until_failed(sched, 30)
    sched.close()
    assert [(f.tag, f.reason) for f in failed] == [("g", reason)]
    assert sched.inflight == 0


def test_a_module_name_taken_by_another_folder_is_a_config_error(tmp_path: Path) -> None:
    """Two folders each with `clash_mod.py`: Python would reuse the first one imported for the
    second path, silently running the wrong code."""
    first, second = tmp_path / "a", tmp_path / "b"
    for folder, value in ((first, 1), (second, 2)):
        folder.mkdir()
        (folder / "clash_mod.py").write_text(f"def fn():\n    return {value}\n")
    try:
        assert load_object("clash_mod:fn", [str(first)])() == 1
        assert load_object("clash_mod:fn", [str(first)])() == 1  # the same folder again is fine
        with pytest.raises(ValueError, match=r"already imported from .*a/clash_mod\.py"):
            load_object("clash_mod:fn", [str(second)])
    finally:
        sys.modules.pop("clash_mod", None)
