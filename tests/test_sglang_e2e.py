"""A short asynchronous run with rollouts on an SGLang-shaped server (`asyncrl serve`): the same
invariants as the builtin engine — versions advance, lag-0 log-probs are exact, staleness stays
bounded, run accounting balances."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from asyncrl.runstate import Counter

from role_procs import Role, RoleConfig, asyncrl, step_lines, stop_all, wait_until

pytestmark = pytest.mark.timeout(600)
STEPS = 6


def test_async_run_through_sglang_client(
    served: str, tmp_path: Path, role_config: RoleConfig
) -> None:
    run_sglang(served, tmp_path, role_config, {}, max_diff=1e-4)


def run_sglang(
    served: str,
    tmp_path: Path,
    role_config: RoleConfig,
    settings: dict[str, Any],
    *,
    max_diff: float,
) -> None:
    """The run above with `settings` on top (`test_sglang_lora.py` adds `model.lora`), checked
    the same way; lag-0 log-probs within `max_diff` of the trainer's."""
    run_dir = tmp_path / "run"
    config = role_config(
        "sglang-e2e",
        {
            **settings,
            "task.type": "arithmetic",
            "rollout.n": 4,
            "rollout.prompts_per_batch": 4,
            "rollout.engine": {"type": "sglang", "urls": [served]},
            "weights.type": "sglang",
            "rollout.sampling.max_new_tokens": 4,
            "trainer.max_steps": STEPS,
            "trainer.groups_per_step": 4,
            "trainer.checkpoint_every": 3,
            "trainer.eval_every": 0,
            "algo.max_staleness": 0,
            "algo.filter_zero_variance": False,
        },
    )
    trainer = Role("trainer", config, tmp_path / "trainer.log")
    worker = Role("rollout", config, tmp_path / "rollout.log", "--worker-id", "sg-0")
    try:
        wait_until(lambda: not trainer.alive(), 400, "trainer finishes", [worker])
        assert trainer.proc.returncode == 0, trainer.tail()
    finally:
        stop_all([worker, trainer])
    steps = step_lines(run_dir)
    assert [s["version"] for s in steps] == list(range(1, STEPS + 1))
    assert all(s["staleness_max"] == 0 for s in steps)
    diffs = [s["behaviour_logprob_abs_diff_lag0"] for s in steps]
    assert all(d is not None and d < max_diff for d in diffs), diffs
    status = asyncrl("status", "--json", "--config", str(config))
    report = json.loads(status.stdout)
    assert report["balanced"], report
    assert report["counters"][Counter.GROUPS_TRAINED] == STEPS * 4
