"""Environments out of process, end to end: a multi-turn environment written outside the repo,
served by `asyncrl env-server` in its own process, drives `asyncrl launch --role all` on the
warmed quickstart model. One run trains on it; another meets an environment that raises, hangs
and answers malformed on a share of its episodes, and an env-server SIGKILLed mid-run: the run
finishes, its counters balance, and every failed group is a dead letter by reason."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import textwrap
import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from asyncrl.environments.server import spawn
from asyncrl.runstate import Counter as RunCounter

from role_procs import (
    CHILD_ENV,
    REPO,
    Launched,
    check_accounting,
    check_trained_on,
    dead_letters,
    step_lines,
)

pytestmark = pytest.mark.timeout(900)

EXAMPLE = REPO / "examples" / "env_server" / "calculator_env.py"

# The calculator example, and a log line per closed episode so the test sees its turns.
LOGGED = """
import json, os
from calculator_env import Calculator

class Logged(Calculator):
    async def close(self):
        with open(os.environ["EPISODE_LOG"], "a") as f:
            f.write(json.dumps({"turns": len(self._rewards)}) + "\\n")
        await super().close()
"""

# Fails by the item's sum: one episode in eight raises, one hangs, one answers a NaN reward;
# every step waits a little, so that episodes are in flight when a server is killed.
FLAKY = """
import asyncio, math
from asyncrl.environments import StepResult

class Flaky:
    async def reset(self, item):
        a, b = item.prompt.rstrip("=").split("+")
        self.sum = int(a) + int(b)
        self.mode = ["raise", "hang", "nan", "ok", "ok", "ok", "ok", "ok"][self.sum % 8]
        self.turns = 0

    async def step(self, response):
        await asyncio.sleep(0.05)
        self.turns += 1
        if self.mode == "raise":
            raise RuntimeError("the tool broke")
        if self.mode == "hang":
            await asyncio.sleep(3600)
        if self.mode == "nan":
            return StepResult(None, done=True, reward=math.nan)
        if self.turns < 2:
            return StepResult(f"<bos>{self.sum}+0=", done=False)
        return StepResult(None, done=True, reward=float(response.strip() == str(self.sum)))

    async def close(self):
        pass
"""


@contextmanager
def env_server(
    user: Path, env: str, **extra_env: str
) -> Iterator[tuple[str, subprocess.Popen[str]]]:
    """`asyncrl env-server --env ENV --port 0` in its own process; (its URL, the process)."""
    environ = {**os.environ, **CHILD_ENV, **extra_env}
    proc, url = spawn(env, "--python-path", str(user), environ=environ, quiet=True)
    try:
        yield url, proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def _remote(*urls: str, **extra: object) -> str:
    return "task.environment=" + json.dumps({"type": "remote", "urls": list(urls), **extra})


@pytest.mark.slow
def test_a_served_multi_turn_environment_trains_end_to_end(
    launched_here: Launched, tmp_path: Path, user_code: Path
) -> None:
    shutil.copy(EXAMPLE, user_code / "calculator_env.py")
    (user_code / "logged_env.py").write_text(textwrap.dedent(LOGGED))
    episodes = tmp_path / "episodes.jsonl"
    steps, groups, n = 6, 16, 4
    with env_server(user_code, "logged_env:Logged", EPISODE_LOG=str(episodes)) as (url, _):
        run = launched_here(
            "env-trains",
            _remote(url),
            f"trainer.max_steps={steps}",
            f"trainer.groups_per_step={groups}",
            f"rollout.n={n}",
            "rollout.prompts_per_batch=16",
            # Every trained group keeps its tokens in the step's count (see below).
            "algo.filter_zero_variance=false",
        )
    assert dead_letters(run.url, "env-trains") == []
    check_accounting(run, steps, groups)
    # Every episode ended after its two turns at the server and was closed there, but those of
    # groups a worker gave up early, sure to be dropped stale (η = 1 here).
    turns = [json.loads(line)["turns"] for line in episodes.read_text().splitlines()]
    cut = len(turns) - turns.count(2)
    assert turns.count(2) >= steps * groups * n and set(turns) <= {0, 1, 2}
    assert cut <= n * run.status["counters"][RunCounter.GROUPS_DROPPED_STALE], turns
    # Trained tokens per sample exceed what one turn can hold (max_new_tokens=4): both turns
    # are trained on, the observation between them is not.
    lines = step_lines(run.dir)
    per_sample = sum(line["tokens"] for line in lines) / (steps * groups * n)
    assert 4 < per_sample <= 8, per_sample
    # The warmed model answers a sum right about a third of the time: the mean reward is
    # neither 0 nor 1, so the groups carry a learning signal.
    rewards = [s["reward_mean"] for s in run.steps]
    assert 0.05 < sum(rewards) / len(rewards) < 0.95, rewards


@pytest.mark.slow
def test_failing_and_killed_env_servers_are_dead_letters_by_reason(
    launched_here: Launched, tmp_path: Path, user_code: Path
) -> None:
    (user_code / "flaky_env.py").write_text(textwrap.dedent(FLAKY))
    steps, groups = 5, 8
    run_dir = tmp_path / "run"
    with (
        env_server(user_code, "flaky_env:Flaky") as (doomed, doomed_proc),
        env_server(user_code, "flaky_env:Flaky") as (survivor, _),
    ):

        def kill_after_first_step() -> None:
            deadline = time.monotonic() + 300
            while time.monotonic() < deadline and not step_lines(run_dir):
                time.sleep(0.2)
            os.kill(doomed_proc.pid, signal.SIGKILL)

        killer = threading.Thread(target=kill_after_first_step, daemon=True)
        killer.start()
        run = launched_here(
            "env-fails",
            _remote(doomed, survivor, timeout_s=1.0, retries=1),
            f"trainer.max_steps={steps}",
            f"trainer.groups_per_step={groups}",
            "rollout.n=4",
            "rollout.prompts_per_batch=8",
        )
        killer.join(5)
        assert doomed_proc.poll() is not None  # it was killed while the run went on
    counters = check_trained_on(run, steps, groups)
    letters = dead_letters(run.url, "env-fails")
    reasons = Counter(reason for reason, _ in letters)
    assert {"env_error", "env_timeout", "env_malformed", "env_unavailable"} <= set(reasons), reasons
    assert sum(reasons.values()) == counters[RunCounter.GROUPS_DEAD_LETTERED]
    details = dict(letters)
    assert "RuntimeError: the tool broke" in details["env_error"]
    assert "reward=nan" in details["env_malformed"]
    assert "no reply in 1.0s" in details["env_timeout"]
