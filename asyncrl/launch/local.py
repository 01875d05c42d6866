"""Local mode (`asyncrl launch --role all`): embedded Redis, `trainer.ranks` trainer ranks (joined
by torch.distributed as torchrun would join them), `rollout.workers` rollout workers.

Every process it starts is its own child in its own session (so Ctrl-C reaches only the launcher),
stopped by its handle with SIGTERM on exit, Ctrl-C, SIGTERM or SIGHUP: first the roles (the
trainer writes its final checkpoint), then the embedded Redis. Should the launcher die without
doing so (SIGKILL), the kernel kills the roles and sends the embedded Redis SIGTERM. The Redis
data (AOF) and checkpoints stay in the run directory, so running the same command again resumes,
and `asyncrl status` can inspect a finished run. A rollout worker that dies is restarted.

The embedded Redis gets a password made for each start. It reaches the children by environment;
`{run.dir}/redis/url` (mode 0600, removed at exit) holds the URL with it for `asyncrl status`.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol, TypeVar

import yaml

from asyncrl.config import Config
from asyncrl.launch import process
from asyncrl.launch.redis_server import RedisServer, embedded_redis, free_port, write_secret
from asyncrl.metrics.record import MISMATCH_LOG, ROLLOUT_LOG
from asyncrl.redis_conn import redact_url, split_password, with_password
from asyncrl.runstate import Keys

if TYPE_CHECKING:
    from asyncrl.launch.progress import Progress

# A rollout worker that exits is restarted at most this often.
MAX_RESTARTS = 10
# What a run writes into its run directory; `--fresh` removes exactly these.
RUN_STATE = (
    "checkpoints",
    "redis",
    "weights",
    "logs",
    "metrics.jsonl",
    ROLLOUT_LOG,
    MISMATCH_LOG,
    "config.yaml",
    "plots",
    "profile",
)


def prepare_run_dir(
    run_dir: Path, args: argparse.Namespace
) -> tuple[Literal["live", "quiet", "json"], Callable[[str], None]]:
    """`--fresh` removes the run state; returns the progress mode and the launcher's printer."""
    if args.fresh:
        for name in RUN_STATE:
            target = run_dir / name
            if target.is_dir():
                shutil.rmtree(target)
            elif target.exists():
                target.unlink()
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    mode: Literal["live", "quiet", "json"] = args.progress or (
        "live" if sys.stdout.isatty() else "quiet"
    )
    say: Callable[[str], None] = (
        (lambda msg: None) if mode == "json" else (lambda msg: print(msg, flush=True))
    )
    return mode, say


def start_logged(
    argv: list[str], log_path: Path, env: dict[str, str], **popen: Any
) -> subprocess.Popen[bytes]:
    """Start `argv` in a session of its own, so that a Ctrl-C or a signal to the caller's
    process group reaches it only through its handle; no stdin, its output appended to
    `log_path`."""
    with log_path.open("ab") as log:
        return subprocess.Popen(
            argv,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,
            **popen,
        )


class Restartable(Protocol):
    """A rollout process as the launcher's watch loop sees it."""

    name: str
    restarts: int

    def poll(self) -> int | None: ...


R = TypeVar("R", bound=Restartable)


def supervise(
    trainer_exited: Callable[[], int | None],
    rollouts: Sequence[R],
    restart: Callable[[R], None],
    progress: Progress,
    say: Callable[[str], None],
    trainer_logs: str,
) -> int:
    """Until `trainer_exited()` gives the trainer's exit status: keep the progress line fresh and
    restart a rollout worker that exits, up to `MAX_RESTARTS` times each (a worker that keeps
    dying is left down; the run goes on with the others). Returns the trainer's status."""
    try:
        while (rc := trainer_exited()) is None:
            progress.update()
            for role in rollouts:
                if (code := role.poll()) is not None and role.restarts < MAX_RESTARTS:
                    say(f"{role.name} exited with {code}; restarting")
                    role.restarts += 1
                    restart(role)
            time.sleep(0.5)
        progress.update()
    finally:
        progress.close()
    if rc != 0:
        say(f"trainer exited with {rc}; see {trainer_logs}")
    return rc


def trainer_names(ranks: int) -> list[str]:
    """The trainer ranks' names (and log files): `trainer`, or `trainer-{rank}` for several."""
    return ["trainer"] if ranks == 1 else [f"trainer-{rank}" for rank in range(ranks)]


def rendezvous_env(ranks: int, addr: str, port: int) -> list[dict[str, str]]:
    """torchrun's environment for each trainer rank: rank 0 at `addr:port` is the rendezvous.
    LOCAL_RANK (the device index) is the rank: the caller overrides it where each rank sees
    only its own device."""
    common = {"MASTER_ADDR": addr, "MASTER_PORT": str(port), "WORLD_SIZE": str(ranks)}
    return [{**common, "RANK": str(r), "LOCAL_RANK": str(r)} for r in range(ranks)]


def ranks_exited(ranks: Sequence[Restartable]) -> int | None:
    """None while the trainer runs; else its exit status: the first failing rank's, or 0 once
    every rank has finished (a failed rank stops the run: the others cannot go on alone)."""
    codes = [rank.poll() for rank in ranks]
    failed = [c for c in codes if c]
    if failed:
        return failed[0]
    return 0 if all(c == 0 for c in codes) else None


def interrupted(exc: KeyboardInterrupt, say: Callable[[str], None]) -> int:
    """Ctrl-C, SIGTERM or SIGHUP: the exit status to give; the roles are stopped after."""
    say(f"{str(exc) or 'interrupted'}: stopping (run the same command again to resume)")
    return process.exit_status(exc)


class Child:
    def __init__(self, name: str, argv: list[str], log_path: Path, env: dict[str, str]) -> None:
        self.name, self.argv, self.log_path, self.env = name, argv, log_path, env
        self.proc: subprocess.Popen[bytes] | None = None
        self.restarts = 0

    def start(self) -> None:
        self.proc = start_logged(
            self.argv,
            self.log_path,
            self.env,
            # SIGKILL, not SIGTERM: a draining trainer whose Redis goes with the launcher
            # would wait for it forever; its checkpoint and pending entries cover the kill.
            preexec_fn=process.die_with_parent(signal.SIGKILL),
        )

    def poll(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def terminate(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def wait(self, timeout_s: float) -> None:
        if self.proc is not None:
            process.wait_or_kill(self.proc, timeout_s)


def check_metrics_ports(cfg: Config) -> None:
    """Before anything starts: the ports `run_local` hands its children (trainer `metrics.port`,
    rollout worker i `metrics.port + 1 + i`) are free, else a ConfigError naming the key."""
    from asyncrl.config import ConfigError
    from asyncrl.metrics.server import first_taken, port_in_use

    first, n = cfg.metrics.port, cfg.rollout.workers
    if not first:
        return
    taken = first_taken(cfg.metrics.host, range(first, first + 1 + n))
    if taken is not None:
        uses = f" (local mode serves the trainer and {n} rollout worker(s) on {first}..{first + n})"
        raise ConfigError(port_in_use(cfg.metrics.host, taken, uses))


def run_local(cfg: Config, args: argparse.Namespace) -> int:
    from asyncrl.launch.progress import Progress
    from asyncrl.model import ensure_model
    from asyncrl.redis_conn import connect

    check_metrics_ports(cfg)
    run_dir = cfg.run.path
    mode, say = prepare_run_dir(run_dir, args)
    process.stop_signals_interrupt()

    server: RedisServer | None = None
    children: list[Child] = []
    try:
        url = cfg.redis.url
        if url is None:
            server = embedded_redis(run_dir / "redis")
            url = server.client_url
            write_secret(run_dir / "redis" / "url", url)
            say(f"embedded redis-server at {redact_url(url)} (data in {run_dir / 'redis'})")
        env = dict(os.environ)
        # Secrets travel to the children by environment, never in argv.
        url, password = split_password(url)
        if password is not None:
            env[cfg.redis.password_env] = password
        env.setdefault("OMP_NUM_THREADS", "1")
        env["PYTHONUNBUFFERED"] = "1"

        say(f"model: {cfg.model.path}")
        ensure_model(cfg)
        # The saved config keeps redis.url as given (unset = embedded), so `asyncrl status
        # --config run_dir/config.yaml` finds the embedded Redis or its AOF later.
        config_path = run_dir / "config.yaml"
        config_path.write_text(yaml.safe_dump(cfg.redacted(), sort_keys=False))
        base = [sys.executable, "-m", "asyncrl", "launch", "--config", str(config_path)]
        base.append(f"redis.url={url}")
        if server is not None and cfg.redis.password_file is not None:
            base.append("redis.password_file=null")  # it would win over the run's password
        port = cfg.metrics.port

        def metrics_port(i: int) -> list[str]:
            return [f"metrics.port={port + i}"] if port else []

        ranks = cfg.trainer.ranks
        dist_env = rendezvous_env(ranks, "127.0.0.1", free_port()) if ranks > 1 else [{}]
        trainers = [
            Child(
                name,
                # Every rank gets the port; only rank 0 serves metrics.
                [*base, "--role", "trainer", *metrics_port(0)],
                run_dir / "logs" / f"{name}.log",
                {**env, **dist_env[rank]},
            )
            for rank, name in enumerate(trainer_names(ranks))
        ]
        children.extend(trainers)
        rollouts: list[Child] = []
        for i in range(cfg.rollout.workers):
            wid = f"rollout-{i}"
            argv = [*base, "--role", "rollout", "--worker-id", wid, *metrics_port(1 + i)]
            rollouts.append(Child(wid, argv, run_dir / "logs" / f"{wid}.log", env))
        children.extend(rollouts)
        for child in children:
            child.start()
        say(
            f"started {ranks} trainer rank(s) and {cfg.rollout.workers} rollout worker(s); "
            f"logs in {run_dir}/logs"
        )
        client = connect(cfg.redis, with_password(url, password))
        progress = Progress(mode, run_dir, client, Keys(cfg.run.id), cfg.trainer.max_steps)
        return supervise(
            lambda: ranks_exited(trainers),
            rollouts,
            Child.start,
            progress,
            say,
            str(trainers[0].log_path if ranks == 1 else run_dir / "logs"),
        )
    except KeyboardInterrupt as exc:
        return interrupted(exc, say)
    finally:
        process.ignore_stop_signals()
        for child in children:
            child.terminate()
        for child in children:
            child.wait(30.0)
        if server is not None:
            server.stop()
            (run_dir / "redis" / "url").unlink(missing_ok=True)
