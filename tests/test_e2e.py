"""End to end: `asyncrl launch --role all` on the warmed quickstart model, then the run's
contracts read back from its metrics log, its checkpoints and its Redis (an external one, via
`redis.url`, so that it outlives the run and `asyncrl status` can read it)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from asyncrl.launch.redis_server import RedisServer
from asyncrl.runstate import Counter
from asyncrl.trainer.checkpoint import list_checkpoints

from role_procs import QUICKSTART, Run, asyncrl, check_accounting

# The first test pays for building the warmed model and the run (over a minute on 2 busy cores).
pytestmark = pytest.mark.timeout(900)

ETA = 1
ASYNC_STEPS = 25
ASYNC_GROUPS = 32


def launch_all(
    run_dir: Path, url: str, model: Path, run_id: str, *overrides: str, mode: str = "async"
) -> Run:
    # Everything the assertions rely on is pinned here: the quickstart file is tuned separately.
    proc = asyncrl(
        "launch",
        "--role",
        "all",
        "--config",
        str(QUICKSTART),
        "--progress",
        "quiet",
        "--fresh",
        "--mode",
        mode,
        f"run.id={run_id}",
        f"run.dir={run_dir}",
        f"redis.url={url}",
        f"model.path={model}",
        "model.build_tiny=false",
        "metrics.port=0",
        "rollout.workers=1",
        "rollout.sampling.temperature=1.0",
        "rollout.sampling.max_new_tokens=4",
        "trainer.eval_every=0",
        "trainer.checkpoint_every=10",
        "trainer.keep_checkpoints=2",
        "trainer.wait_timeout_s=120",
        "weights.type=broadcast",
        *overrides,
        timeout=600,
    )
    output = proc.stdout + proc.stderr
    log = run_dir / "metrics.jsonl"
    lines = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    status = asyncrl(
        "status", "--json", "--config", str(run_dir / "config.yaml"), f"redis.url={url}"
    )
    assert status.returncode == 0, status.stderr
    return Run(
        dir=run_dir,
        url=url,
        rc=proc.returncode,
        output=output,
        steps=[line for line in lines if "reward_mean" in line],
        status=json.loads(status.stdout),
    )


@pytest.fixture(scope="module")
def async_run(
    module_redis: RedisServer, warm_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Run:
    run = launch_all(
        tmp_path_factory.mktemp("async") / "run",
        module_redis.url,
        warm_model,
        "e2e-async",
        f"trainer.max_steps={ASYNC_STEPS}",
        f"trainer.groups_per_step={ASYNC_GROUPS}",
        "trainer.lr=1e-3",
        "trainer.lr_decay=none",
        "rollout.n=8",
        "rollout.prompts_per_batch=32",
        f"algo.max_staleness={ETA}",
        "algo.loss=ppo",
        "algo.advantage=grpo",
    )
    assert run.rc == 0, run.output[-5000:]
    return run


@pytest.fixture(scope="module")
def sync_run(
    module_redis: RedisServer, warm_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Run:
    run = launch_all(
        tmp_path_factory.mktemp("sync") / "run",
        module_redis.url,
        warm_model,
        "e2e-sync",
        "trainer.max_steps=4",
        "trainer.groups_per_step=8",
        "rollout.n=4",
        "rollout.prompts_per_batch=8",
        "algo.max_staleness=3",  # sync mode must win over it: η = 0
        mode="sync",
    )
    assert run.rc == 0, run.output[-5000:]
    return run


@pytest.mark.slow
def test_async_run_learns(async_run: Run) -> None:
    rewards = [s["reward_mean"] for s in async_run.steps]
    assert len(rewards) == ASYNC_STEPS
    first, last = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    assert last > first + 0.05, rewards


@pytest.mark.slow
def test_async_run_versions_and_staleness(async_run: Run) -> None:
    steps = async_run.steps
    assert [s["step"] for s in steps] == list(range(1, ASYNC_STEPS + 1))
    # A fresh run publishes version 0, then one new version per step.
    assert [s["version"] for s in steps] == list(range(1, ASYNC_STEPS + 1))
    for s in steps:
        assert s["groups"] == ASYNC_GROUPS
        assert 0 <= s["staleness_mean"] <= s["staleness_max"] <= ETA, s
    assert any(s["staleness_max"] > 0 for s in steps), "the run never ran asynchronously"


@pytest.mark.slow
def test_async_run_lag0_logprobs_agree(async_run: Run) -> None:
    diffs = [s["behaviour_logprob_abs_diff_lag0"] for s in async_run.steps]
    measured = [d for d in diffs if d is not None]
    assert measured, "no step had lag-0 tokens"
    assert max(measured) < 1e-4, diffs
    for s in async_run.steps:
        assert (s["behaviour_logprob_abs_diff_lag0"] is None) == (s["lag0_tokens"] == 0)


@pytest.mark.slow
def test_async_run_accounting(async_run: Run) -> None:
    check_accounting(async_run, ASYNC_STEPS, ASYNC_GROUPS)


@pytest.mark.slow
def test_async_run_checkpoints_load(async_run: Run, warm_model: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ckpts = list_checkpoints(async_run.dir / "checkpoints")
    assert [p.name for p in ckpts] == ["step_00000020", f"step_{ASYNC_STEPS:08d}"]
    latest = ckpts[-1]
    state = json.loads((latest / "trainer_state.json").read_text())
    assert state["step"] == ASYNC_STEPS
    assert state["version"] == ASYNC_STEPS
    model = AutoModelForCausalLM.from_pretrained(latest)
    tokenizer = AutoTokenizer.from_pretrained(latest)
    start = AutoModelForCausalLM.from_pretrained(warm_model)
    ids = torch.tensor([tokenizer("12+34=")["input_ids"]])
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    assert torch.isfinite(logits).all()
    trained, initial = model.state_dict(), start.state_dict()
    assert any(not torch.equal(trained[k], initial[k]) for k in initial), "weights never moved"


@pytest.mark.slow
def test_sync_run_has_no_staleness(sync_run: Run) -> None:
    steps = sync_run.steps
    assert [s["step"] for s in steps] == [1, 2, 3, 4]
    assert [s["version"] for s in steps] == [1, 2, 3, 4]
    for s in steps:
        assert s["staleness_max"] == 0 and s["staleness_mean"] == 0, s
        # Every token was generated by the weights being trained: lag 0 throughout.
        assert s["lag0_tokens"] > 0
        assert s["behaviour_logprob_abs_diff_lag0"] < 1e-4
    check_accounting(sync_run, 4, 8)
    assert sync_run.status["counters"][Counter.GROUPS_DROPPED_STALE] == 0


def test_cli_help() -> None:
    top = asyncrl("--help")
    assert top.returncode == 0, top.stderr
    assert "launch" in top.stdout and "status" in top.stdout
    sub = asyncrl("launch", "--help")
    assert sub.returncode == 0, sub.stderr
    assert "--role" in sub.stdout
    assert "trainer" in sub.stdout and "rollout" in sub.stdout
