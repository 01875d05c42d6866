"""End to end on configs/agentic.yaml: `asyncrl launch --role all` with multi-turn episodes, then
the run's accounting and the trajectories it published, read back from Redis. A probe consumer
group on the trajectories stream (never acking) keeps every entry from being trimmed."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import redis

from asyncrl.launch.redis_server import RedisServer
from asyncrl.protocol import decode_group
from asyncrl.runstate import Keys

from role_procs import QUICKSTART, Run, asyncrl, check_accounting

AGENTIC = QUICKSTART.parent / "agentic.yaml"
STEPS, GROUPS, N, TURNS = 3, 4, 4, 2


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_agentic_run_balances_and_masks_observations(
    redis_server: RedisServer, redis_client: redis.Redis, random_model: Path, tmp_path: Path
) -> None:
    keys = Keys("agentic-e2e")
    redis_client.xgroup_create(keys.trajectories, "probe", id="0", mkstream=True)
    run_dir = tmp_path / "run"
    proc = asyncrl(
        "launch",
        "--role",
        "all",
        "--config",
        str(AGENTIC),
        "--progress",
        "quiet",
        f"run.id={keys.run_id}",
        f"run.dir={run_dir}",
        f"redis.url={redis_server.url}",
        f"model.path={random_model}",
        "model.build_tiny=false",
        "metrics.port=0",
        f"trainer.max_steps={STEPS}",
        f"trainer.groups_per_step={GROUPS}",
        "trainer.checkpoint_every=10",
        "trainer.wait_timeout_s=60",
        # The final eval runs held-out episodes, tools and all, in the trainer.
        f"trainer.eval_every={STEPS}",
        "trainer.eval_size=3",
        "trainer.eval_samples=2",
        f"rollout.n={N}",
        "rollout.max_inflight_episodes=32",
        f"task.turns={TURNS}",
        "task.tool_latency_median_s=0.05",
        "algo.max_staleness=2",
        # An untrained model earns reward 0 everywhere: keep its groups so that steps train.
        "algo.filter_zero_variance=false",
        timeout=240,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]
    status = asyncrl("status", "--json", "--config", str(run_dir / "config.yaml"))
    assert status.returncode == 0, status.stderr

    run = Run(run_dir, redis_server.url, 0, "", [], json.loads(status.stdout))
    check_accounting(run, STEPS, GROUPS)
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = [line for line in lines if "eval_accuracy" in line]
    assert [e["step"] for e in evals] == [STEPS]
    assert 0.0 <= evals[0]["eval_accuracy"] <= 1.0

    entries = redis_client.xrange(keys.trajectories)
    groups = [decode_group(fields[b"data"]) for _, fields in entries]
    assert len(groups) >= STEPS * GROUPS
    for g in groups:
        assert len(g.samples) == N
        for s in g.samples:
            assert s.meta == {"turns": TURNS}
            mask = s.loss_mask
            assert mask is not None
            observed = s.response_ids[mask == 0]
            # One observation: the second question, `<bos>` first, ending in `=`.
            assert observed[0] == 1 and observed[-1] == 14 and len(observed) == 7
            assert (s.logprobs[mask == 0] == 0).all()
            assert (s.logprobs[mask == 1] < 0).all()
            assert (np.diff(s.versions) >= 0).all()
