"""A whole run on the tiny random Qwen3-MoE with routing captured at rollout and replayed in the
trainer: every step line says the trainer routed every recorded token as the engine did, the
mismatch log and `asyncrl mismatch` carry the per-layer agreement, and the accounting balances."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from asyncrl.launch.redis_server import RedisServer
from asyncrl.metrics.record import MISMATCH_LOG

from role_procs import asyncrl, check_accounting, launch_all

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]

STEPS, GROUPS = 2, 4


def test_replayed_run_agrees_everywhere(
    redis_server: RedisServer, random_moe: Path, tmp_path: Path
) -> None:
    run = launch_all(
        tmp_path / "run",
        redis_server.url,
        random_moe,
        "moe-replay",
        f"trainer.max_steps={STEPS}",
        f"trainer.groups_per_step={GROUPS}",
        "rollout.n=4",
        "rollout.prompts_per_batch=4",
        "rollout.capture_routing=true",
        "algo.routing_replay=true",
        "algo.filter_zero_variance=false",  # a random model scores 0 everywhere
        "algo.max_staleness=1",
    )
    assert run.rc == 0, run.output[-5000:]
    assert len(run.steps) == STEPS
    for step in run.steps:
        # Prompt and response tokens of every sample, all with a recorded routing.
        assert step["routing_tokens"] > 0
        assert step["routing_agreement"] == 1.0 and step["routing_agreement_worst_layer"] == 1.0
        assert 0.0 <= step["routing_agreement_router"] <= 1.0
    lines = [json.loads(x) for x in (run.dir / MISMATCH_LOG).read_text().splitlines()]
    assert all(
        line["routing"]["replay"] and len(line["routing"]["agreement"]) == 2 for line in lines
    )
    out = asyncrl("mismatch", str(run.dir), "--out", str(tmp_path / "plots"))
    assert out.returncode == 0, out.stderr
    assert "routing agreement (rollout vs trainer top-k sets), replay on" in out.stdout
    check_accounting(run, STEPS, GROUPS)
