"""The tutorial that follows getting-started (docs/tutorials/first-agent.md), run as a new user
runs it: its files written from the page's titled code blocks into a folder of their own, its
bash commands run there as written (the checkout's asyncrl on the path). The agent it trains is
the page's; the run must have trained: every step recorded, the queue balanced, and every
trajectory the agent's calls, with the engine's log-probs and versions."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import redis
import yaml

from asyncrl.launch.redis_server import RedisServer
from asyncrl.protocol import decode_group
from asyncrl.runstate import Counter, Keys

from doc_commands import commands, files
from role_procs import CHILD_ENV, REPO, step_lines

PAGE = REPO / "docs" / "tutorials" / "first-agent.md"


def _run(argv: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    """A page's command: `.venv/bin/X` is this interpreter's, the repo's code on the path."""
    program = Path(argv[0]).name
    if program == "asyncrl":
        argv = [sys.executable, "-m", "asyncrl", *argv[1:]]
    else:
        assert program == "python", f"the page runs {argv[0]}: teach this test what it is"
        argv = [sys.executable, *argv[1:]]
    return subprocess.run(
        argv,
        cwd=cwd,
        env={**os.environ, **CHILD_ENV},
        capture_output=True,
        text=True,
        timeout=480,
    )


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_first_agent_page_trains_its_agent(tmp_path: Path) -> None:
    written = files(PAGE)
    assert set(written) == {"my_agent.py", "my_agent.yaml"}
    for name, text in written.items():
        (tmp_path / name).write_text(text)
    argvs = commands(PAGE)
    assert [Path(a[0]).name for a in argvs] == ["pip", "python", "asyncrl", "asyncrl"]
    pip, *runs = argvs
    assert pip[1] == "install"
    for package in pip[2:]:  # installed here by the dev extra; the test installs nothing
        importlib.import_module(package)
    run_dir = tmp_path / "runs" / "my-agent"
    for argv in runs:
        proc = _run(argv, tmp_path)
        logs = [f"--- {p.name}\n{p.read_text()[-3000:]}" for p in run_dir.glob("logs/*.log")]
        assert proc.returncode == 0, "\n".join([str(argv), proc.stdout + proc.stderr, *logs])

    config = yaml.safe_load(written["my_agent.yaml"])
    steps = config["trainer"]["max_steps"]
    groups = steps * config["trainer"]["groups_per_step"]
    n = config["rollout"]["n"]
    lines = step_lines(run_dir)
    assert [s["step"] for s in lines] == list(range(1, steps + 1))
    # The agent's own reward varies within groups: the steps had gradients to follow.
    assert all(line["grad_norm"] > 0 for line in lines), lines
    status = json.loads(
        _run(
            ["asyncrl", "status", "--json", "--config", str(run_dir / "config.yaml")], tmp_path
        ).stdout
    )
    assert status["balanced"] is True and status["version"] == steps, status
    assert status["counters"][Counter.GROUPS_TRAINED] == groups
    assert status["counters"][Counter.GROUPS_DEAD_LETTERED] == 0

    # What was trained, read back from the run's own (embedded) Redis data.
    with (
        RedisServer(data_dir=run_dir / "redis") as server,
        redis.Redis.from_url(server.url) as client,
    ):
        trajectories = client.xrange(Keys("my-agent").trajectories)
    trained = [decode_group(f[b"data"]) for _, f in trajectories]
    assert len(trained) >= groups
    for group in trained:
        assert len(group.samples) >= n
        for s in group.samples:
            assert 0 <= s.reward <= 1
            assert 1 <= int(s.meta["calls"]) <= config["task"]["agent"]["max_calls"], s.meta
            mask = s.loss_mask
            assert mask is not None and (mask == 1).any()
            if int(s.meta["calls"]) > 1:  # the tool results between its calls: not trained
                assert (mask == 0).any()
            assert (s.logprobs[mask == 1] < 0).all() and (s.logprobs[mask == 0] == 0).all()
            assert (np.diff(s.versions) >= 0).all() and s.versions.max() <= steps
