"""An in-process environment (`task.environment.type: python`) whose code ends its process's way
— `sys.exit()`, a CancelledError of its own, KeyboardInterrupt — on a share of its episodes, in
real processes: the run trains on, each such group a dead letter `env_error`; and a worker whose
environments' event loop is ended past every guard stops with one line, its heartbeat gone, its
prompts left to be delivered again."""

from __future__ import annotations

import json
import textwrap
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from asyncrl.runstate import Counter as RunCounter
from asyncrl.runstate import Keys

from role_procs import (
    Launched,
    Role,
    arithmetic_admission,
    check_trained_on,
    dead_letters,
    pending_prompts,
    wait_until,
)

pytestmark = pytest.mark.timeout(900)

# By the item's sum: three episodes in eight end their process's way; the rest take two turns.
EXITING = """
import asyncio, sys
from asyncrl.environments import StepResult

RAISES = {0: lambda: sys.exit(3), 1: asyncio.CancelledError, 2: KeyboardInterrupt}

class Exiting:
    def __init__(self, later=False):
        self.later = later

    async def reset(self, item):
        a, b = item.prompt.rstrip("=").split("+")
        self.sum, self.turns = int(a) + int(b), 0

    async def step(self, response):
        self.turns += 1
        if self.later:  # a callback of its own, which no guard of a call reaches
            asyncio.get_running_loop().call_soon(sys.exit, 3)
        if self.sum % 8 in RAISES:
            raise RAISES[self.sum % 8]()
        if self.turns < 2:
            return StepResult(f"<bos>{self.sum}+0=", done=False)
        return StepResult(None, done=True, reward=float(response.strip() == str(self.sum)))

    async def close(self):
        pass
"""


def _environment(user: Path, **kwargs: Any) -> str:
    (user / "exiting_env.py").write_text(textwrap.dedent(EXITING))
    env = {"type": "python", "path": "exiting_env:Exiting", "python_path": [str(user)]}
    return json.dumps({**env, "kwargs": kwargs})


@pytest.mark.slow
def test_an_environment_that_exits_fails_its_groups_and_the_run_trains_on(
    launched_here: Launched, user_code: Path
) -> None:
    steps, groups = 4, 8
    run = launched_here(
        "env-exits",
        f"task.environment={_environment(user_code)}",
        f"trainer.max_steps={steps}",
        f"trainer.groups_per_step={groups}",
        "rollout.n=2",
        "rollout.prompts_per_batch=8",
    )
    counters = check_trained_on(run, steps, groups)
    letters = dead_letters(run.url, "env-exits")
    reasons = Counter(r for r, _ in letters)
    assert set(reasons) == {"env_error"} and reasons["env_error"] > 0, reasons
    assert reasons["env_error"] == counters[RunCounter.GROUPS_DEAD_LETTERED]
    details = {d.split(":")[0] for _, d in letters}
    assert details <= {
        "step raised SystemExit",
        "step raised CancelledError",
        "step raised KeyboardInterrupt",
    }, details


@pytest.mark.timeout(300)
def test_a_worker_whose_event_loop_dies_stops_with_one_line_and_its_heartbeat(
    redis_client: Any, random_model: Path, role_config: Any, tmp_path: Path, user_code: Path
) -> None:
    keys = Keys("loopdies")
    config = role_config(
        keys.run_id,
        {
            "rollout.prompts_per_batch": 2,
            "task.type": "arithmetic",
            "task.environment": json.loads(_environment(user_code, later=True)),
        },
    )
    admission = arithmetic_admission(redis_client, keys, random_model, n=2, max_staleness=1)
    worker = Role("rollout", config, tmp_path / "rollout.log", "--worker-id", "A")
    try:
        heartbeat = keys.worker("rollout", "A")
        wait_until(
            lambda: bool(redis_client.exists(heartbeat)), 180, "the worker starting", [worker]
        )
        assert admission.release(step=0, version=0) == 2
        assert worker.wait(120) == 1, worker.tail()
        said = [line for line in worker.tail().splitlines() if "event loop died" in line]
        assert len(said) == 1 and "SystemExit: 3" in said[0], worker.tail()
        assert "Traceback" not in worker.tail()
        assert not redis_client.exists(heartbeat)
        assert len(pending_prompts(redis_client, keys, "A")) == 2  # delivered again later
    finally:
        worker.kill()
