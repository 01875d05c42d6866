"""Helpers of the role tests: write their config, run `asyncrl` commands and `asyncrl launch
--role trainer|rollout` processes against a test Redis, wait on them, and read back what they
wrote. Every process is started here, in its own session, and stopped or killed by its handle
only."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis

from asyncrl.config import write_config
from asyncrl.launch.local import start_logged
from asyncrl.runstate import PROMPTS_GROUP, TRAJECTORIES_GROUP, Counter, Keys

from doc_commands import asyncrl_args

REPO = Path(__file__).resolve().parent.parent
QUICKSTART = REPO / "configs" / "quickstart.yaml"
# The quickstart as the getting-started page gives it (`launch --role all --config ...`): the
# runs of `launch_all` start with exactly these arguments, so the page's command is what they run.
GETTING_STARTED = asyncrl_args(REPO / "docs" / "getting-started.md", "launch")
# What the `role_config` fixture gives: (run id, dotted settings) → the config file.
RoleConfig = Callable[[str, dict[str, Any]], Path]
# What the `launched` fixture gives: (run id, *overrides, mode=) → the finished run, exited 0.
Launched = Callable[..., "Run"]
# Settings under which a rollout worker that dies or hangs is found out within about 2 s: its
# heartbeat lapses and the prompts it holds can be claimed by another.
QUICK_TAKEOVER = {"rollout.heartbeat_ttl_s": 1.5, "queue.claim_idle_s": 1.0}
# A quickstart-shaped run of separate roles (`write_role_config` settings): small groups, short
# answers, broadcast weight sync, no eval, training until stopped.
SMALL_RUN = {
    "rollout.n": 2,
    "rollout.sampling.max_new_tokens": 4,
    "trainer.groups_per_step": 2,
    "trainer.max_steps": 10**6,
    "trainer.checkpoint_every": 2,
    "trainer.eval_every": 0,
    "weights.type": "broadcast",
}
# The children import asyncrl from this checkout and share the test machine's cores.
CHILD_ENV = {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}


@dataclass
class Run:
    """What an `asyncrl launch` run left: its exit and output, its step lines, `asyncrl status`."""

    dir: Path
    url: str
    rc: int
    output: str
    steps: list[dict[str, Any]]
    status: dict[str, Any]


def write_role_config(
    tmp_path: Path, redis_url: str, model: Path, run_id: str, settings: dict[str, Any]
) -> Path:
    """`tmp_path / "config.yaml"` for role processes of the run `run_id`, run dir
    `tmp_path / "run"`, on `redis_url` and `model`, no metrics endpoint; `settings` (dotted keys)
    on top."""
    return write_config(
        tmp_path / "config.yaml",
        {
            "run.id": run_id,
            "run.dir": str(tmp_path / "run"),
            "redis.url": redis_url,
            "model.path": str(model),
            "metrics.port": 0,
            **settings,
        },
    )


def asyncrl(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """`python -m asyncrl ARGS` run to its end, its output captured."""
    return subprocess.run(
        [sys.executable, "-m", "asyncrl", *args],
        cwd=REPO,
        env={**os.environ, **CHILD_ENV},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


class Role:
    """One `asyncrl launch --role ROLE` child process, its output in `log`."""

    def __init__(self, role: str, config: Path, log: Path, *args: str) -> None:
        env = {**os.environ, **CHILD_ENV}
        log.parent.mkdir(parents=True, exist_ok=True)
        self.log = log
        argv = [sys.executable, "-m", "asyncrl", "launch", "--role", role, "--config", str(config)]
        self.proc = start_logged([*argv, *args], log, env, cwd=REPO)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL: no handler runs, nothing is flushed or acked."""
        if self.alive():
            self.proc.kill()
        self.proc.wait()

    def stop(self, timeout_s: float = 60.0) -> int:
        """SIGTERM (drain and leave), then SIGKILL if it does not exit in time."""
        if self.alive():
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            raise

    def wait(self, timeout_s: float) -> int:
        return self.proc.wait(timeout_s)

    def tail(self, chars: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-chars:] if self.log.exists() else ""


def trainer_and_worker(config: Path, logs: Path) -> list[Role]:
    """A trainer and one rollout worker, `w0`, on `config`; their logs in `logs`."""
    return [
        Role("trainer", config, logs / "trainer.log"),
        Role("rollout", config, logs / "w0.log", "--worker-id", "w0"),
    ]


def arithmetic_admission(
    client: Any, keys: Any, model: Path, *, n: int, max_staleness: int, groups_per_step: int = 1
) -> Any:
    """The trainer's admission over the quickstart's arithmetic task, run from the test process
    to release prompts to real rollout workers without a trainer."""
    from transformers import AutoTokenizer

    from asyncrl.tasks.build import build_task
    from asyncrl.tasks.config import ArithmeticTaskConfig
    from asyncrl.trainer.admission import Admission, Cursor

    return Admission(
        client,
        keys,
        build_task(ArithmeticTaskConfig(), AutoTokenizer.from_pretrained(model)),
        task_name="arithmetic",
        n=n,
        max_staleness=max_staleness,
        groups_per_step=groups_per_step,
        cursor=Cursor(seed=0),
    )


def stop_all(roles: Iterable[Role]) -> None:
    for r in roles:
        with contextlib.suppress(subprocess.TimeoutExpired):
            r.stop(30.0)


def wait_until(
    cond: Callable[[], bool], timeout_s: float, what: str, roles: Iterable[Role] = ()
) -> None:
    """Poll `cond` every 20 ms; fail with the logs of `roles` if it does not hold in time or a
    role exits meanwhile."""
    roles = list(roles)
    deadline = time.monotonic() + timeout_s
    while not cond():
        for r in roles:
            assert r.alive(), f"{what}: {r.log.name} exited with {r.proc.poll()}:\n{r.tail()}"
        assert time.monotonic() < deadline, f"{what}: timed out\n" + "\n".join(
            f"--- {r.log.name}\n{r.tail()}" for r in roles
        )
        time.sleep(0.02)


def _pending(client: redis.Redis, stream: str, group: str, consumer: str | None) -> set[str]:
    try:
        rows = client.xpending_range(stream, group, "-", "+", 10_000, consumername=consumer)
    except redis.ResponseError:  # no consumer group yet
        return set()
    return {r["message_id"].decode() for r in rows}


def pending_prompts(client: redis.Redis, keys: Keys, consumer: str | None = None) -> set[str]:
    """The prompt ids rollout workers (`consumer` only, if given) read and have not acked."""
    return _pending(client, keys.prompts, PROMPTS_GROUP, consumer)


def pending_groups(client: redis.Redis, keys: Keys) -> set[str]:
    """The trajectory ids the trainer read and has not acked."""
    return _pending(client, keys.trajectories, TRAJECTORIES_GROUP, None)


def dead_letters(url: str, run_id: str) -> list[tuple[str, str]]:
    """(reason, detail) of each of the run's dead letters."""
    client = redis.Redis.from_url(url)
    try:
        letters = client.xrange(Keys(run_id).dlq)
    finally:
        client.close()
    return [(f[b"reason"].decode(), f[b"detail"].decode()) for _, f in letters]


def step_lines(run_dir: Path) -> list[dict[str, Any]]:
    """The trainer's step lines in `metrics.jsonl` (eval lines left out)."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    lines = []
    for raw in path.read_text().splitlines():
        try:
            record = json.loads(raw)
        except ValueError:
            continue  # a line being written
        if "reward_mean" in record:
            lines.append(record)
    return lines


def children_of(pid: int) -> dict[int, str]:
    """The running child processes of `pid`, read from /proc: pid → command line."""
    found = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            # The command name may hold spaces and parentheses: fields follow the last ")".
            state, ppid = stat.read_text().rsplit(")", 1)[1].split()[:2]
            cmdline = (stat.parent / "cmdline").read_bytes()
        except (OSError, IndexError):
            continue  # exited meanwhile
        if int(ppid) == pid and state != "Z":
            found[int(stat.parent.name)] = cmdline.replace(b"\0", b" ").decode(errors="replace")
    return found


def listening(pid: int) -> set[tuple[str, int]]:
    """(address, port) of the TCP sockets process `pid` listens on, from /proc."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = fd.readlink().as_posix()
        except OSError:
            continue  # closed meanwhile
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = set()
    for table, width in (("tcp", 4), ("tcp6", 16)):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] != "0A" or fields[9] not in inodes:  # 0A: LISTEN
                continue
            addr_hex, port_hex = fields[1].split(":")
            # /proc prints the address as native-endian 32-bit words.
            raw = b"".join(
                int(addr_hex[i : i + 8], 16).to_bytes(4, "little") for i in range(0, 2 * width, 8)
            )
            family = socket.AF_INET if width == 4 else socket.AF_INET6
            found.add((socket.inet_ntop(family, raw), int(port_hex, 16)))
    return found


def is_running(pid: int) -> bool:
    """Whether process `pid` exists and is no zombie (an orphan's zombie may wait for a PID 1
    that never reaps it)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def local_run_config(
    path: Path, run_dir: Path, model: Path, extra: dict[str, Any] | None = None
) -> Path:
    """A quickstart-shaped `--role all` run (one trainer, one rollout worker, `extra` settings
    on top) that stops only when told."""
    return write_config(
        path,
        {
            "run.id": "local",
            "run.dir": str(run_dir),
            "model.path": str(model),
            "model.build_tiny": False,
            "rollout.workers": 1,
            "rollout.n": 2,
            "rollout.prompts_per_batch": 2,
            "rollout.sampling.max_new_tokens": 4,
            "trainer.groups_per_step": 2,
            "trainer.max_steps": 10_000,
            "trainer.checkpoint_every": 10_000,  # the only checkpoint: the one SIGTERM writes
            "trainer.eval_every": 0,
            "metrics.port": 0,
            **(extra or {}),
        },
    )


def kill_all(pids: list[int]) -> None:
    """SIGKILL what a failed test left running of the processes it started."""
    for pid in pids:
        if is_running(pid):
            os.kill(pid, signal.SIGKILL)


def check_trained_on(run: Run, steps: int, groups_per_step: int) -> dict[str, int]:
    """A run that met failures trained on: it exited 0 after every step, balanced, each step's
    groups trained; its counters."""
    assert run.rc == 0, run.output[-5000:]
    assert [s["step"] for s in run.steps] == list(range(1, steps + 1))
    status = run.status
    counters: dict[str, int] = status["counters"]
    assert status["balanced"] is True, status
    assert counters[Counter.GROUPS_TRAINED] == steps * groups_per_step
    return counters


def check_accounting(run: Run, steps: int, groups_per_step: int) -> None:
    """`asyncrl status` of a finished run: balanced, every step's groups trained once and acked,
    nothing dead-lettered, every role gone."""
    status = run.status
    counters, streams = status["counters"], status["streams"]
    queued = sum(streams[s]["lag"] + streams[s]["pending"] for s in ("prompts", "trajectories"))
    assert counters[Counter.PROMPTS_RELEASED] == (
        counters[Counter.GROUPS_TRAINED]
        + counters[Counter.GROUPS_DROPPED_STALE]
        + counters[Counter.GROUPS_DEAD_LETTERED]
        + queued
    ), status
    assert status["balanced"] is True
    # Every step's groups were acked once, at the checkpoint that holds the step.
    assert counters[Counter.GROUPS_TRAINED] == steps * groups_per_step
    assert streams["trajectories"]["pending"] == 0  # the final checkpoint acked everything
    assert counters[Counter.GROUPS_DEAD_LETTERED] == 0
    assert streams["dlq"]["length"] == 0
    assert status["version"] == steps
    assert status["last_step"]["step"] == steps
    assert status["workers"] == {"rollout": [], "trainer": []}  # all stopped cleanly


def launch_all(
    run_dir: Path, url: str, model: Path, run_id: str, *overrides: str, mode: str = "async"
) -> Run:
    # Everything the assertions rely on is pinned here: the quickstart file is tuned separately.
    proc = asyncrl(
        *GETTING_STARTED,
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


def free_ports(n: int) -> int:
    """The first of `n` consecutive free loopback ports (local mode gives child i port + i)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + n > 65535:
            continue
        try:
            held = []
            for port in range(base, base + n):
                sock = socket.socket()
                held.append(sock)
                sock.bind(("127.0.0.1", port))
        except OSError:
            continue
        finally:
            for sock in held:
                sock.close()
        return base
    raise RuntimeError("no run of free loopback ports")
