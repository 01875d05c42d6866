"""`asyncrl launch --role all` (local mode) as a real process: SIGTERM stops its trainer ranks
(two, `--trainer-ranks 2`), its rollout worker and its embedded redis-server, the trainer writing
its final checkpoint; children die with a launcher that is killed outright; the embedded Redis
requires its run's password; `--fresh` clears every per-run file and keeps the user's."""

from __future__ import annotations

import argparse
import json
import re
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import redis

from asyncrl.launch.local import prepare_run_dir
from asyncrl.runstate import Counter

from role_procs import (
    REPO,
    Role,
    asyncrl,
    children_of,
    is_running,
    kill_all,
    local_run_config,
    step_lines,
    wait_until,
)

ENV = "ASYNCRL_REDIS_PASSWORD"


@pytest.mark.slow
def test_sigterm_stops_the_roles_then_the_embedded_redis(
    random_model: Path, tmp_path: Path
) -> None:
    run_dir = tmp_path / "run"
    config = local_run_config(tmp_path / "config.yaml", run_dir, random_model)
    launcher = Role(
        "all", config, tmp_path / "launcher.log", "--progress", "quiet", "--trainer-ranks", "2"
    )
    children: dict[int, str] = {}
    try:
        wait_until(lambda: len(step_lines(run_dir)) >= 1, 300, "a first step", [launcher])
        children = children_of(launcher.proc.pid)
        assert sum("redis-server" in c for c in children.values()) == 1, children
        assert sum("--role trainer" in c for c in children.values()) == 2, children
        assert sum("--role rollout" in c for c in children.values()) == 1, children

        # The embedded Redis has a password of its own, in a file only its owner may read.
        url_file = run_dir / "redis" / "url"
        assert stat.S_IMODE(url_file.stat().st_mode) == 0o600
        url = url_file.read_text().strip()
        password = redis.Redis.from_url(url).connection_pool.connection_kwargs["password"]
        assert password
        bare = redis.Redis.from_url(url.replace(f":{password}@", ""))
        with pytest.raises(redis.AuthenticationError):
            bare.ping()
        bare.close()
        for pid, cmdline in children.items():
            assert password not in cmdline
            if "--role" in cmdline:  # the roles get it by environment
                environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
                assert f"{ENV}={password}".encode() in environ, cmdline
        assert password not in (run_dir / "config.yaml").read_text()

        launcher.proc.send_signal(signal.SIGTERM)
        assert launcher.wait(120) == 128 + signal.SIGTERM, launcher.tail()
        left = [pid for pid in children if is_running(pid)]
        assert not left, {pid: children[pid] for pid in left}
    finally:
        kill_all([launcher.proc.pid, *children])
    assert "SIGTERM: stopping" in launcher.tail()
    # The ranks joined one group, each reading as its own consumer: each says so in its log.
    for rank in range(2):
        log = (run_dir / "logs" / f"trainer-{rank}.log").read_text()
        assert re.search(rf"trainer trainer-{rank}: step \d+, version \d+, 2 rank\(s\)", log)
    assert not url_file.exists()

    # The trainer drained: its final checkpoint holds the last step, whose groups are acked
    # (those it had read ahead stay pending for the resumed run).
    last = step_lines(run_dir)[-1]["step"]
    checkpoint = run_dir / "checkpoints" / f"step_{last:08d}" / "trainer_state.json"
    assert json.loads(checkpoint.read_text())["step"] == last
    status = asyncrl("status", "--json", "--config", str(config), timeout=120)
    assert status.returncode == 0, status.stderr
    report = json.loads(status.stdout)
    assert report["counters"][Counter.GROUPS_TRAINED] == 2 * last, report
    assert report["balanced"], report


def test_children_die_with_a_killed_parent(tmp_path: Path) -> None:
    """A parent that starts a process with `die_with_parent(SIGKILL)` (the roles) and an
    embedded Redis is SIGKILLed: the kernel ends both (Redis by SIGTERM, fsyncing its AOF)."""
    code = (
        "import signal, subprocess, sys, time\n"
        "from pathlib import Path\n"
        "from asyncrl.launch.process import die_with_parent\n"
        "from asyncrl.launch.redis_server import embedded_redis\n"
        "server = embedded_redis(Path(sys.argv[1]))\n"
        "role = subprocess.Popen(['sleep', '600'], preexec_fn=die_with_parent(signal.SIGKILL))\n"
        "print(server.proc.pid, role.pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    parent = subprocess.Popen(
        [sys.executable, "-c", code, str(tmp_path / "redis")],
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )
    pids: list[int] = []
    try:
        assert parent.stdout is not None
        pids = [int(p) for p in parent.stdout.readline().split()]
        assert len(pids) == 2 and all(is_running(p) for p in pids)
        parent.kill()
        parent.wait()
        wait_until(lambda: not any(is_running(p) for p in pids), 30, "children gone")
    finally:
        kill_all([parent.pid, *pids])


def test_fresh_clears_the_run_files_and_keeps_the_users(tmp_path: Path) -> None:
    """A fresh run must not append to the last run's logs: `mismatch.jsonl` (the trainer's
    per-step mismatch tables, which `asyncrl mismatch` reads back) goes with `metrics.jsonl`."""
    run = tmp_path / "run"
    (run / "checkpoints" / "step_00000010").mkdir(parents=True)
    for name in ("metrics.jsonl", "rollout.jsonl", "mismatch.jsonl", "config.yaml", "notes.txt"):
        (run / name).write_text('{"step": 10}\n')
    prepare_run_dir(run, argparse.Namespace(fresh=True, progress="quiet"))
    assert sorted(p.name for p in run.iterdir()) == ["logs", "notes.txt"]
