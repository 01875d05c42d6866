"""`asyncrl launch --role all --launcher ray`: the roles of a run as Ray actors.

Each actor holds the resources of one role process and runs the ordinary role entry point as a
child process, `asyncrl launch --role trainer|rollout` — the same command as local mode and
Kubernetes — so the trainer's SIGTERM drain (checkpoint, then ack) and its logs behave the same
everywhere. Trainer ranks share one placement group (PACK: ranks close together for the collective
backend), `trainer.ranks` of them, with torchrun's environment (MASTER_ADDR/PORT at rank 0's
node, RANK, WORLD_SIZE, LOCAL_RANK) set per actor. Rollout workers are single actors
that may land anywhere, and one whose process exits (or whose node goes) is started again, as in
local mode.

Where: `--ray-address ADDR` (or `RAY_ADDRESS`, which `ray job submit` and KubeRay's RayJob set)
joins an existing cluster; without one, a local Ray is started with `num_cpus=2`. Accelerators,
per role: a trainer rank's from `trainer.device`, a rollout worker's from `rollout.engine.device`
(the builtin engine's one device, or all the devices of the SGLang servers the worker launches;
none when it attaches to running servers); cuda → `GPU`, npu → `NPU`, auto → whichever the
cluster has. Ray then sets `CUDA_VISIBLE_DEVICES` / `ASCEND_RT_VISIBLE_DEVICES` for each actor,
so every rank sees its one device as device 0. On a cluster the run directory and `model.path`
must be on storage that every node mounts at the same path (as on Kubernetes); the role
processes start in the driver's working directory when their node has it.

Redis: `redis.url`, or else an embedded redis-server on the driver (AOF in the run directory, as in
local mode, with a password made for each start, which reaches the roles by environment only).
On a local Ray it listens on loopback; on a cluster on the driver's node address too.

Ctrl-C, SIGTERM and SIGHUP to the driver stop the roles (SIGTERM: the trainer checkpoints), then
Ray, then the embedded Redis; a role process dies with its actor (`process.die_with_parent`).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import tempfile
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import yaml

from asyncrl.config import Config
from asyncrl.launch import process
from asyncrl.launch.local import (
    interrupted,
    prepare_run_dir,
    ranks_exited,
    rendezvous_env,
    supervise,
    trainer_names,
)
from asyncrl.launch.redis_server import RedisServer, embedded_redis, write_secret
from asyncrl.redis_conn import redact_url, split_password, with_password
from asyncrl.runstate import Keys

if TYPE_CHECKING:
    from ray import ObjectRef
    from ray.actor import ActorHandle
    from ray.util.placement_group import PlacementGroup

# How long to wait for the cluster to grant the trainer ranks' resources before giving up.
PLACEMENT_TIMEOUT_S = 600.0
# The local Ray's object store: the roles move weights over torch.distributed or Redis, not Ray,
# so Ray's default (30 % of memory in shared memory) would only be reserved for nothing.
LOCAL_OBJECT_STORE_BYTES = 128 * 1024**2


class RoleProcess:
    """A Ray actor that owns one `asyncrl launch --role ...` process on its node.

    Methods return at once (the driver polls), so one actor thread is enough.
    """

    def __init__(self) -> None:
        self.proc: subprocess.Popen[bytes] | None = None
        self.config_path: str | None = None

    def node_ip(self) -> str:
        import ray

        return str(ray.util.get_node_ip_address())

    def free_port(self) -> int:
        from asyncrl.launch.redis_server import free_port

        return free_port()

    def start(
        self, config_yaml: str, argv: list[str], env: dict[str, str], cwd: str, log: str
    ) -> None:
        """Writes the config to a file of this node, then starts `asyncrl launch --config FILE
        ARGV` with `env` added to the actor's own environment (device visibility set by Ray)."""
        fd, self.config_path = tempfile.mkstemp(prefix="asyncrl-", suffix=".yaml")
        with os.fdopen(fd, "w") as f:
            f.write(config_yaml)
        workdir = cwd if os.path.isdir(cwd) else None
        log_path = Path(workdir or ".") / log
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with log_path.open("ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "asyncrl", "launch", "--config", self.config_path, *argv],
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env={**os.environ, **env},
                cwd=workdir,
                # Ray kills an actor's process (ray.kill, a dead driver) without asking it to
                # stop its child; an actor runs its methods on its main thread, the parent here.
                preexec_fn=process.die_with_parent(signal.SIGKILL),
            )

    def poll(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def stop(self, timeout_s: float) -> int | None:
        """SIGTERM (the roles drain on it), SIGKILL after `timeout_s`; the exit status."""
        if self.proc is None:
            return None
        status = process.stop(self.proc, timeout_s)
        if self.config_path is not None:
            Path(self.config_path).unlink(missing_ok=True)
        return status


@cache
def _remote_role_process() -> Any:
    """`RoleProcess` as a Ray actor class, made once per driver."""
    import ray

    return ray.remote(RoleProcess)


class _Role:
    """Driver-side handle of one role: what it needs from Ray, and how to (re)start it.

    Nothing here waits for Ray to place the actor: a rollout worker may wait for resources (an
    autoscaling cluster adding a node) while the run goes on without it.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self.options: dict[str, Any] = {}
        self.argv: list[str] = []
        self.env: dict[str, str] = {}
        self.actor: ActorHandle | None = None
        self.started: ObjectRef[None] | None = None
        self.restarts = 0

    def create(self) -> ActorHandle:
        self.actor = _remote_role_process().options(**self.options).remote()
        return self.actor

    def start(self, config_yaml: str, run_dir: Path) -> None:
        actor = self.actor or self.create()
        log = str(run_dir / "logs" / f"{self.name}.log")
        self.started = actor.start.remote(config_yaml, self.argv, self.env, os.getcwd(), log)

    def _placed(self) -> bool:
        """Whether the actor runs and has answered `start` (with the process or an error)."""
        import ray

        return self.started is not None and bool(ray.wait([self.started], timeout=0)[0])

    def poll(self) -> int | None:
        """The process' exit status; None while it runs or its actor waits to be placed; -1 when
        it could not start or the actor is gone (its node failed): `start` then places anew."""
        import ray

        if self.actor is None or self.started is None:
            return -1  # gone, and not started again (restarts used up)
        if not self._placed():
            return None
        try:
            ray.get(self.started)
            return cast("int | None", ray.get(self.actor.poll.remote(), timeout=60.0))
        except ray.exceptions.GetTimeoutError:
            return None  # a busy node: ask again next time
        except ray.exceptions.RayError:
            ray.kill(self.actor)
            self.actor = None
            return -1

    def stop(self, timeout_s: float) -> None:
        import ray

        if self.actor is None:
            return
        if self._placed():
            # An actor that fails or hangs here is gone with its node, and so is its process.
            with contextlib.suppress(ray.exceptions.RayError):
                ray.get(self.actor.stop.remote(timeout_s), timeout=timeout_s + 30.0)
        ray.kill(self.actor)
        self.actor = None


def _accelerator(device: str, cluster: dict[str, float]) -> str | None:
    """The Ray resource a process on `device` needs besides a CPU: GPU, NPU or none."""
    if device == "auto":
        device = "cuda" if cluster.get("GPU") else "npu" if cluster.get("NPU") else "cpu"
    return {"cuda": "GPU", "npu": "NPU"}.get(device)


def _rollout_devices(cfg: Config) -> tuple[str, str, int]:
    """The config key naming a rollout worker's device, its value, and how many the process
    uses: the builtin engine's one, or every device of the SGLang servers it launches (none for
    servers it only attaches to)."""
    engine = cfg.rollout.engine
    if engine.type == "torch":
        return "rollout.engine.device", engine.device, 1
    count = engine.servers * engine.devices_per_server if engine.launch else 0
    return "rollout.engine.device", engine.device, count


def _role_resources(
    cfg: Config, cluster: dict[str, float], local: bool
) -> tuple[dict[str, float], dict[str, float]]:
    """Ray resources of one trainer rank and of one rollout worker: a CPU each, and each role's
    accelerator as its own device key says. On a cluster whole devices; on a local Ray, like
    local mode, the processes share the machine's devices when there are fewer."""
    rollout_key, rollout_device, count = _rollout_devices(cfg)
    needs = [
        ("trainer.device", cfg.trainer.device, 1, cfg.trainer.ranks),
        (rollout_key, rollout_device, count, cfg.rollout.workers),
    ]
    accelerators = [_accelerator(device, cluster) if n else None for _, device, n, _ in needs]
    demand: dict[str, float] = {}
    for accelerator, (_, _, per_process, processes) in zip(accelerators, needs, strict=True):
        if accelerator is not None:
            demand[accelerator] = demand.get(accelerator, 0.0) + per_process * processes
    resources: list[dict[str, float]] = []
    for accelerator, (key, device, per_process, _) in zip(accelerators, needs, strict=True):
        if accelerator is None:
            resources.append({"CPU": 1.0})
            continue
        share = _device_share(accelerator, cluster, demand[accelerator]) if local else 1.0
        if share == 0:
            raise SystemExit(
                f"asyncrl: {key}={device} needs a {accelerator}; this machine's Ray found none "
                f"({cluster})"
            )
        resources.append({"CPU": 1.0, accelerator: per_process * share})
    return resources[0], resources[1]


def _actor_options(resources: dict[str, float]) -> dict[str, Any]:
    """`resources` as the options of a Ray actor."""
    options: dict[str, Any] = {"num_cpus": resources.get("CPU", 1.0)}
    if "GPU" in resources:
        options["num_gpus"] = resources["GPU"]
    if others := {k: v for k, v in resources.items() if k not in ("CPU", "GPU")}:
        options["resources"] = others
    return options


def _device_share(accelerator: str, cluster: dict[str, float], demand: float) -> float:
    """The part of a device each of `demand` wanted devices gets on a local Ray: a whole one,
    or an equal part of the machine's when it has fewer."""
    return min(1.0, cluster.get(accelerator, 0.0) / demand)


def _placement_group(bundle: dict[str, float], ranks: int) -> PlacementGroup:
    import ray
    from ray.util.placement_group import placement_group

    pg = placement_group([dict(bundle) for _ in range(ranks)], strategy="PACK")
    if not pg.wait(timeout_seconds=PLACEMENT_TIMEOUT_S):
        ray.util.remove_placement_group(pg)
        raise SystemExit(
            f"Ray could not place {ranks} trainer rank(s) of {bundle} within "
            f"{PLACEMENT_TIMEOUT_S:.0f} s; the cluster has {ray.cluster_resources()}"
        )
    return pg


def _init_ray(address: str | None, processes: int) -> None:
    import ray

    if address is not None:
        ray.init(address=address, log_to_driver=False)
        return
    # A local Ray on this machine only: nothing to report anywhere.
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    ray.init(
        # A CPU per role process, as local mode starts them all whatever the core count: two
        # for the quickstart's trainer and rollout worker.
        num_cpus=max(2, processes),
        include_dashboard=False,
        log_to_driver=False,
        object_store_memory=LOCAL_OBJECT_STORE_BYTES,
    )


def run_ray(cfg: Config, args: argparse.Namespace) -> int:
    """Runs the trainer (`trainer.ranks` ranks) and `rollout.workers` rollout workers on Ray
    until the trainer exits; returns its exit status (130 on Ctrl-C)."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from asyncrl.launch.progress import Progress
    from asyncrl.model import ensure_model
    from asyncrl.redis_conn import connect

    run_dir = cfg.run.path
    mode, say = prepare_run_dir(run_dir, args)

    address = args.ray_address or os.environ.get("RAY_ADDRESS") or None
    if address is not None and address.startswith("ray://"):
        # Through Ray Client this driver (and its embedded Redis) would sit outside the cluster.
        print(
            "asyncrl: --ray-address: run the launcher on a node of the cluster (auto or "
            "HOST:PORT, e.g. with `ray job submit`), not through Ray Client (ray://)",
            file=sys.stderr,
        )
        return 2
    server: RedisServer | None = None
    trainer_ranks = cfg.trainer.ranks
    trainers = [_Role(name) for name in trainer_names(trainer_ranks)]
    rollouts = [_Role(f"rollout-{i}") for i in range(cfg.rollout.workers)]
    pg: PlacementGroup | None = None
    _init_ray(address, processes=len(trainers) + len(rollouts))
    # After ray.init, whose handler would take Ray down under the roles without stopping them.
    process.stop_signals_interrupt()
    try:
        url = cfg.redis.url
        if url is None:
            on_cluster = () if address is None else (ray.util.get_node_ip_address(),)
            server = embedded_redis(run_dir / "redis", *on_cluster)
            url = server.client_url
            if address is not None:
                url = url.replace("127.0.0.1", ray.util.get_node_ip_address())
            write_secret(run_dir / "redis" / "url", url)
            say(f"embedded redis-server at {redact_url(url)} (data in {run_dir / 'redis'})")
        # Secrets travel to the roles by environment, never in argv or configs; the roles on
        # other nodes do not share the driver's environment, so it is passed on.
        url, password = split_password(url)
        if password is None:
            password = cfg.redis.password()
        env = {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        if password is not None:
            env[cfg.redis.password_env] = password
        overrides = [f"redis.url={url}"]
        if server is not None and cfg.redis.password_file is not None:
            overrides.append("redis.password_file=null")  # it would win over the run's password

        say(f"model: {cfg.model.path}")
        ensure_model(cfg)
        config_yaml = yaml.safe_dump(cfg.redacted(), sort_keys=False)
        (run_dir / "config.yaml").write_text(config_yaml)

        trainer_resources, rollout_resources = _role_resources(
            cfg, ray.cluster_resources(), local=address is None
        )
        pg = _placement_group(trainer_resources, trainer_ranks)
        for rank, role in enumerate(trainers):
            strategy = PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=rank)
            role.options = {**_actor_options(trainer_resources), "scheduling_strategy": strategy}
            role.create()
        rank0 = trainers[0].actor
        assert rank0 is not None
        master_addr = "127.0.0.1"
        if address is not None:
            master_addr = str(ray.get(rank0.node_ip.remote()))
            weights = cfg.weights  # the store transport has no rendezvous address
            if weights.type != "store" and weights.master_addr in ("127.0.0.1", "localhost"):
                # Rollout workers on other nodes reach the weight broadcast at rank 0's node.
                overrides.append(f"weights.master_addr={master_addr}")
        master_port = cast("int", ray.get(rank0.free_port.remote()))
        dist_env = rendezvous_env(trainer_ranks, master_addr, master_port)
        port = cfg.metrics.port
        for rank, role in enumerate(trainers):
            role.argv = ["--role", "trainer", *overrides]
            role.argv += [f"metrics.port={port}"] if port else []
            # LOCAL_RANK 0: Ray shows each rank only its own device.
            role.env = {**env, **dist_env[rank], "LOCAL_RANK": "0"}
            role.start(config_yaml, run_dir)
        for i, role in enumerate(rollouts):
            role.options = _actor_options(rollout_resources)
            role.argv = ["--role", "rollout", "--worker-id", role.name, *overrides]
            role.argv += [f"metrics.port={port + 1 + i}"] if port else []
            role.env = env
            role.start(config_yaml, run_dir)
        say(
            f"started {trainer_ranks} trainer rank(s) and {len(rollouts)} rollout worker(s) "
            f"on Ray; logs in {run_dir}/logs"
        )

        client = connect(cfg.redis, with_password(url, password))
        progress = Progress(mode, run_dir, client, Keys(cfg.run.id), cfg.trainer.max_steps)
        try:
            return supervise(
                lambda: ranks_exited(trainers),
                rollouts,
                lambda role: role.start(config_yaml, run_dir),
                progress,
                say,
                str(run_dir / "logs"),
            )
        finally:
            client.close()
    except KeyboardInterrupt as exc:
        return interrupted(exc, say)
    finally:
        process.ignore_stop_signals()
        for role in [*rollouts, *trainers]:
            role.stop(30.0)
        if pg is not None:
            ray.util.remove_placement_group(pg)
        ray.shutdown()
        if server is not None:
            server.stop()
            (run_dir / "redis" / "url").unlink(missing_ok=True)
