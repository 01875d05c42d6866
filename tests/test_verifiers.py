"""`task.type: verifiers` with the real verifiers 0.4 in a venv of its own (built once, cached
under pytest's cache directory; about 600 MB and 2-3 minutes the first time, seconds after).
The environment is examples/verifiers_env's `count_env` package, written into each test's
temporary directory: a multi-turn conversation (a prompt, then follow-up user turns) over
verifiers' `null` chat harness, run in the local subprocess runtime, scored by its rubric.

Cost on CI's 2 cores: about a minute per test once the venv exists (verifiers' start-up takes
most of it: each runner imports verifiers and prepares the harness script with `uv`)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import redis

from asyncrl.launch.redis_server import RedisServer
from asyncrl.launch.status import collect_status
from asyncrl.protocol import decode_group
from asyncrl.runstate import Counter, Keys

from gateway_helpers import tool_model
from role_procs import Role, asyncrl, stop_all, write_role_config

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "verifiers_env"
REPLAY = Path(__file__).resolve().parent / "vf_replay_eval.py"
VERIFIERS = "verifiers>=0.4,<0.5"
_UNREACHABLE = (
    "NewConnectionError",
    "Temporary failure in name resolution",
    "Network is unreachable",
    "No matching distribution found for verifiers",
    "ConnectTimeout",
    "No matching distribution found for uv",
    "Failed to fetch",  # uv's words for an index it cannot reach
    "dns error",
)


@pytest.fixture(scope="session")
def vf_python(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The interpreter of a venv with verifiers 0.4 and `uv` (which verifiers runs harness
    scripts with); `ASYNCRL_TEST_VERIFIERS_PYTHON` names an existing one instead."""
    given = os.environ.get("ASYNCRL_TEST_VERIFIERS_PYTHON")
    if given:
        return given
    cache = getattr(request.config, "cache", None)  # None under -p no:cacheprovider
    root = cache.mkdir("verifiers-0.4-venv") if cache else tmp_path_factory.mktemp("vfenv")
    python = root / "bin" / "python"
    if (root / "ready").exists():
        return str(python)
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(root)], check=True)
    # uv installs verifiers in ~10 s where pip's resolver takes ~5 min on CI's 2 cores.
    for argv in (
        [str(python), "-m", "pip", "install", "-q", "uv"],
        [str(python), "-m", "uv", "pip", "install", "-q", "--python", str(python), VERIFIERS],
    ):
        done = subprocess.run(argv, capture_output=True, text=True, timeout=900)
        if done.returncode != 0:
            if any(sign in done.stderr for sign in _UNREACHABLE):
                pytest.skip("the package index is unreachable: cannot install verifiers 0.4")
            raise AssertionError(f"installing verifiers failed:\n{done.stderr[-3000:]}")
    (root / "ready").write_text("")
    return str(python)


def env_package(folder: Path) -> Path:
    """count_env written into `folder` (the directory to put on the runner's path)."""
    shutil.copytree(EXAMPLE / "count_env", folder / "count_env")
    return folder


def vf_settings(python: str, envs: Path, **more: Any) -> dict[str, Any]:
    """Config of a run on count_env: 12 tasks of 2 turns, tasks 0-1 held out."""
    return {
        "model.build_tiny": False,
        "task.type": "verifiers",
        "task.env": "count_env",
        "task.python": python,
        "task.python_path": [str(envs)],
        "task.env_args": {"taskset": {"num_tasks": 12, "turns": 2}},
        "task.train_select": {"exclude": {"idx": ["0:2"]}},
        "task.eval_select": {"include": {"idx": ["0:2"]}},
        "task.timeout_s": 300,
        "rollout.sampling.max_new_tokens": 6,
        "trainer.eval_size": 2,
        "trainer.eval_samples": 1,
        **more,
    }


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_verifiers_env_trains_end_to_end(
    vf_python: str, redis_server: RedisServer, redis_client: redis.Redis, tmp_path: Path
) -> None:
    """A trainer and a rollout worker on a multi-turn verifiers environment: every step's
    groups train once, every sample carries behaviour log-probs and versions on the tokens
    the policy sampled (both turns' replies, the second user turn masked between them), and
    the final step record has the held-out reward, measured through the trainer's gateway."""
    steps, groups, n = 2, 2, 2
    model = tool_model(tmp_path / "model")
    keys = Keys("vf-e2e")
    redis_client.xgroup_create(keys.trajectories, "probe", id="0", mkstream=True)
    settings = vf_settings(
        vf_python,
        env_package(tmp_path / "envs"),
        **{
            "rollout.n": n,
            "rollout.prompts_per_batch": 2,
            "trainer.groups_per_step": groups,
            "trainer.max_steps": steps,
            "trainer.eval_every": steps,
            "trainer.wait_timeout_s": 400,
            "algo.max_staleness": 2,
            # An untrained model's rewards may all be equal: keep its groups so that steps train.
            "algo.filter_zero_variance": False,
            "weights.type": "broadcast",
        },
    )
    config = write_role_config(tmp_path, redis_server.url, model, keys.run_id, settings)
    run_dir = tmp_path / "run"
    trainer = Role("trainer", config, tmp_path / "logs" / "trainer.log")
    worker = Role("rollout", config, tmp_path / "logs" / "w0.log", "--worker-id", "w0")
    roles = [trainer, worker]
    try:
        assert trainer.wait(800) == 0, trainer.tail()
        assert worker.stop() == 0, worker.tail()
    finally:
        stop_all(roles)

    status = collect_status(redis_client, keys, run_dir)
    assert status["balanced"] is True, status
    assert status["counters"][Counter.GROUPS_TRAINED] == steps * groups
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = [line for line in lines if "eval_accuracy" in line]
    assert [e["step"] for e in evals] == [steps]
    assert 0.0 <= evals[0]["eval_accuracy"] <= 1.0

    last_version = int(redis_client.get(keys.version) or 0)
    trained = [decode_group(f[b"data"]) for _, f in redis_client.xrange(keys.trajectories)]
    assert len(trained) >= steps * groups
    for g in trained:
        assert str(g.prompt_id).startswith("train:") and len(g.samples) == n
        for s in g.samples:
            mask = s.loss_mask
            assert mask is not None and s.meta["calls"] == 2  # both turns, one sample
            runs = np.flatnonzero(np.diff(mask.astype(np.int8)))
            assert len(runs) >= 2, mask  # reply, masked user turn, reply
            assert (s.logprobs[mask == 1] < 0).all() and (s.logprobs[mask == 0] == 0).all()
            assert (np.diff(s.versions) >= 0).all() and s.versions.max() <= last_version
            assert 0.0 <= s.reward <= 1.0


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_held_out_reward_equals_verifiers_own_eval(vf_python: str, tmp_path: Path) -> None:
    """asyncrl's held-out reward of a verifiers environment (the trainer's `Evaluator`, over a
    loopback gateway) equals verifiers' own eval (`run_eval`, what `vf-eval` runs) of the same
    episodes. Same episodes: verifiers' eval runs each held-out task against a replay endpoint
    that answers a call only when its conversation, message for message, is one asyncrl's
    policy answered (taken from the episodes asyncrl's runner saved with `task.traces_dir`), and
    with that very reply; a call of any other conversation fails its episode. So every episode
    verifiers scores is one asyncrl scored, turn for turn, and the rewards must agree, each
    episode's and their mean."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from asyncrl.config import load_config, write_config
    from asyncrl.evaluate import Evaluator
    from asyncrl.tasks.build import build_task

    model = tool_model(tmp_path / "model")
    envs = env_package(tmp_path / "envs")
    held_out = ["0:3"]
    settings = vf_settings(
        vf_python,
        envs,
        **{
            "model.path": str(model),
            "task.eval_select": {"include": {"idx": held_out}},
            "task.traces_dir": str(tmp_path / "traces"),
            "trainer.eval_size": 3,
            "trainer.eval_temperature": 1.0,
        },
    )
    cfg = load_config(write_config(tmp_path / "c.yaml", settings))
    tokenizer = AutoTokenizer.from_pretrained(model)
    task = build_task(cfg.task, tokenizer)
    assert [item.prompt for item in task.eval_items()] == ["say a", "say aa", "say ab"]
    evaluator = Evaluator(AutoModelForCausalLM.from_pretrained(model), tokenizer, task, cfg)
    measured = evaluator.reward()
    assert measured is not None

    spec = {
        "traces_dir": str(tmp_path / "traces"),
        "env": "count_env",
        "python_path": [str(envs)],
        "env_args": cfg.task.env_args,
        "idx": held_out,
        "out": str(tmp_path / "vf-eval"),
    }
    bin_dir = str(Path(vf_python).parent)
    done = subprocess.run(
        [vf_python, str(REPLAY), json.dumps(spec)],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    theirs = json.loads(done.stdout.strip().splitlines()[-1])
    assert theirs["misses"] == [] and all(theirs["ok"]), theirs
    ours = {}
    for path in (tmp_path / "traces").rglob("traces.jsonl"):
        for line in path.read_text().splitlines():
            episode = json.loads(line)
            ours[str(episode["task"]["data"]["idx"])] = [
                sum(r["score"] * r.get("weight", 1.0) for r in t["rewards"].values())
                for t in episode["traces"]
            ]
    assert sorted(ours) == sorted(theirs["rewards"]) == ["0", "1", "2"]
    for idx, rewards in theirs["rewards"].items():
        assert rewards == pytest.approx(ours[idx], abs=1e-12), idx
    verifiers_mean = float(np.mean([r for rs in theirs["rewards"].values() for r in rs]))
    assert measured == pytest.approx(verifiers_mean, abs=1e-12)


def test_a_verifiers_venv_that_is_none_is_one_config_error(tmp_path: Path) -> None:
    """No verifiers at `task.python`: one line naming the key, exit 2, before any role starts."""
    model = tool_model(tmp_path / "model")
    settings = vf_settings(sys.executable, tmp_path, **{"model.path": str(model)})
    config = write_role_config(tmp_path, "redis://127.0.0.1:1", model, "vf-bad", settings)
    done = asyncrl("launch", "--role", "trainer", "--config", str(config))
    assert done.returncode == 2
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("asyncrl: config error: task.python:") and "verifiers" in line


def _runner_pids() -> list[int]:
    """This process's children that are verifiers runners."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            argv = (stat.parent / "cmdline").read_bytes()
        except (FileNotFoundError, ProcessLookupError):
            continue
        if parent == os.getpid() and b"vf_runner.py" in argv:
            found.append(int(stat.parent.name))
    return found


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_runner_killed_mid_episode_fails_its_group_and_is_restarted(
    vf_python: str, tmp_path: Path
) -> None:
    """SIGKILL the worker's verifiers runner once its episode has made a call: that group
    fails (`agent_error`, the runner's death as detail), the worker goes on, and the next
    episode runs on a fresh runner to its rubric's reward."""
    import signal
    import threading

    from transformers import AutoTokenizer

    from asyncrl.agents.episode import AgentEpisodes
    from asyncrl.engines.config import SamplingParams
    from asyncrl.gateway.config import GatewayConfig
    from asyncrl.gateway.server import Gateway
    from asyncrl.rollout.scheduler import EpisodeScheduler
    from asyncrl.tasks.build import build_agent
    from asyncrl.tasks.config import VerifiersTaskConfig
    from asyncrl.tasks.verifiers import VerifiersTask

    from engine_helpers import make_engine
    from gateway_helpers import dies

    model = tool_model(tmp_path / "model")
    tokenizer = AutoTokenizer.from_pretrained(model)
    cfg = VerifiersTaskConfig(
        env="count_env",
        python=vf_python,
        python_path=[str(env_package(tmp_path / "envs"))],
        env_args={"taskset": {"num_tasks": 2, "turns": 2}},
    )
    task = VerifiersTask(cfg, tokenizer)
    first, second = task.train_items(0, 0)
    called = threading.Event()
    gateway = Gateway(GatewayConfig(), tokenizer, len(tokenizer), lambda _: called.set())
    sched: EpisodeScheduler[str] = EpisodeScheduler(
        make_engine(model),
        task,
        tokenizer,
        SamplingParams(max_new_tokens=6),
        kind=AgentEpisodes(build_agent(cfg), cfg, gateway),
    )
    deadline = time.monotonic() + 400
    try:
        sched.start("killed", first, 1, "killed")
        while not called.is_set():
            assert sched.advance(0.05) == ([], []) and time.monotonic() < deadline
        (victim,) = _runner_pids()
        os.kill(victim, signal.SIGKILL)
        done, failed = sched.advance(0.05)
        while not failed:
            assert time.monotonic() < deadline
            done, failed = sched.advance(0.05)
        assert done == [] and [(f.tag, f.reason) for f in failed] == [("killed", "agent_error")]
        assert "the verifiers runner died (exit -9)" in failed[0].detail
        assert dies(victim)

        sched.start("next", second, 1, "next")
        finished: list[Any] = []
        while not finished:
            finished, failed = sched.advance(0.05)
            assert failed == [] and time.monotonic() < deadline
        (group,) = finished
        (sample,) = group.samples
        assert sample.meta == {"calls": 2} and 0.0 <= sample.reward <= 1.0
        assert _runner_pids() != [victim] and len(_runner_pids()) == 1
    finally:
        sched.close()
    assert _runner_pids() == []
