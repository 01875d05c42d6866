"""The Ray launcher: the pieces that need no Ray, and a short run of two trainer ranks and a
rollout worker on a local CPU Ray.

The run starts Ray in a fresh network namespace holding only loopback (`unshare -n`, root): a
local Ray binds the machine's address and all interfaces otherwise, and tests listen on loopback
only. Skipped where Ray is not installed (`pip install -e '.[ray]'`) or namespaces are not allowed.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from asyncrl.config import load_config
from asyncrl.launch.local import ranks_exited
from asyncrl.launch.ray_launcher import _accelerator, _actor_options, _role_resources
from asyncrl.launch.redis_server import RedisServer
from asyncrl.launch.status import collect_status
from asyncrl.metrics.jsonl import read_jsonl
from asyncrl.metrics.record import is_eval_record
from asyncrl.runstate import Counter, Keys

ROOT = Path(__file__).resolve().parents[1]


class _Exited:
    """Stands in for a role whose process has exited with `code` (None: still running)."""

    def __init__(self, code: int | None) -> None:
        self.code = code

    def poll(self) -> int | None:
        return self.code


@pytest.mark.parametrize(
    ("device", "cluster", "expected"),
    [
        ("auto", {"CPU": 8.0}, None),
        ("auto", {"CPU": 8.0, "GPU": 4.0}, "GPU"),
        ("auto", {"CPU": 8.0, "NPU": 8.0}, "NPU"),
        ("cpu", {"CPU": 8.0, "GPU": 4.0}, None),
        ("npu", {"CPU": 8.0}, "NPU"),
    ],
)
def test_accelerator_of_a_device(
    device: str, cluster: dict[str, float], expected: str | None
) -> None:
    assert _accelerator(device, cluster) == expected


GPUS = {"CPU": 16.0, "GPU": 8.0}


@pytest.mark.parametrize(
    ("overrides", "cluster", "local", "trainer", "rollout"),
    [
        # Each role's own device key: a CPU trainer beside GPU rollout engines, and back.
        (["trainer.device=cpu", "rollout.engine.device=cuda"], GPUS, False,
         {"CPU": 1.0}, {"CPU": 1.0, "GPU": 1.0}),
        (["trainer.device=cuda", "rollout.engine.device=cpu"], GPUS, False,
         {"CPU": 1.0, "GPU": 1.0}, {"CPU": 1.0}),
        # A local Ray shares one GPU among the processes that want it, as local mode does.
        (["trainer.device=cuda", "rollout.engine.device=cuda", "trainer.ranks=2",
          "rollout.workers=1"],
         {"CPU": 4.0, "GPU": 1.0}, True, {"CPU": 1.0, "GPU": 1 / 3}, {"CPU": 1.0, "GPU": 1 / 3}),
        (["trainer.device=auto", "rollout.engine.device=auto"], {"CPU": 4.0, "NPU": 8.0}, True,
         {"CPU": 1.0, "NPU": 1.0}, {"CPU": 1.0, "NPU": 1.0}),
        # A worker launching SGLang servers holds all their devices; one attaching to running
        # servers holds none.
        (["rollout.engine.type=sglang", "weights.type=sglang", "rollout.engine.launch=true",
          "rollout.engine.servers=2", "rollout.engine.devices_per_server=2",
          "trainer.device=cuda"], GPUS, False, {"CPU": 1.0, "GPU": 1.0}, {"CPU": 1.0, "GPU": 4.0}),
        (["rollout.engine.type=sglang", "weights.type=sglang",
          "rollout.engine.urls=[http://127.0.0.1:30000]", "trainer.device=cuda"], GPUS, False,
         {"CPU": 1.0, "GPU": 1.0}, {"CPU": 1.0}),
    ],
)  # fmt: skip
def test_resources_per_role(
    overrides: list[str],
    cluster: dict[str, float],
    local: bool,
    trainer: dict[str, float],
    rollout: dict[str, float],
) -> None:
    cfg = load_config(None, [*overrides, "trainer.groups_per_step=16"])
    got_trainer, got_rollout = _role_resources(cfg, cluster, local)
    assert got_trainer == pytest.approx(trainer)
    assert got_rollout == pytest.approx(rollout)


def test_a_missing_accelerator_names_its_key() -> None:
    cfg = load_config(None, ["trainer.device=cpu", "rollout.engine.device=cuda"])
    with pytest.raises(SystemExit, match=r"rollout\.engine\.device=cuda needs a GPU"):
        _role_resources(cfg, {"CPU": 4.0}, local=True)


def test_actor_options() -> None:
    assert _actor_options({"CPU": 1.0}) == {"num_cpus": 1}
    assert _actor_options({"CPU": 1.0, "GPU": 1.0}) == {"num_cpus": 1, "num_gpus": 1}
    assert _actor_options({"CPU": 1.0, "NPU": 0.5}) == {"num_cpus": 1, "resources": {"NPU": 0.5}}


@pytest.mark.parametrize(
    ("codes", "expected"),
    [([None, None], None), ([0, None], None), ([0, 0], 0), ([None, 3], 3), ([0, -1], -1)],
)
def test_trainer_exit(codes: list[int | None], expected: int | None) -> None:
    roles = [_Exited(c) for c in codes]
    assert ranks_exited(roles) == expected  # type: ignore[arg-type]


def _can_unshare() -> bool:
    if shutil.which("unshare") is None or shutil.which("ip") is None:
        return False
    return subprocess.run(["unshare", "-n", "true"], capture_output=True).returncode == 0


@pytest.mark.slow
def test_short_run_on_local_ray(tmp_path: Path, warm_model: Path) -> None:
    pytest.importorskip("ray", reason="pip install -e '.[ray]'")
    if not _can_unshare():
        pytest.skip("needs `unshare -n` (root, util-linux) and `ip` (iproute2)")
    run_dir = tmp_path / "run"
    launch = [
        sys.executable,
        "-m",
        "asyncrl",
        "launch",
        "--role",
        "all",
        "--launcher",
        "ray",
        "--config",
        str(ROOT / "configs/quickstart.yaml"),
        "--progress",
        "quiet",
        "--fresh",
        "--trainer-ranks",
        "2",
        "run.id=ray",
        f"run.dir={run_dir}",
        f"model.path={warm_model}",
        "rollout.workers=1",
        "trainer.max_steps=4",
        "trainer.checkpoint_every=2",
        "trainer.eval_every=0",
        "metrics.port=0",
    ]
    # `exec` keeps the launcher as the process we hold: a timeout stops it, and it stops Ray.
    script = 'ip link set lo up && exec "$@"'
    result = subprocess.run(
        ["unshare", "-n", "sh", "-c", script, "sh", *launch],
        capture_output=True,
        text=True,
        timeout=300,
        # A RAY_ADDRESS in the environment would send the run to that cluster.
        env={k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"},
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "on Ray" in result.stdout

    steps = [r for r in read_jsonl(run_dir / "metrics.jsonl") if not is_eval_record(r)]
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    # The run's Redis is gone with the launcher; its AOF holds the final accounting.
    with RedisServer(data_dir=run_dir / "redis") as server:
        import redis

        client = redis.Redis.from_url(server.url)
        try:
            status = collect_status(client, Keys("ray"), run_dir)
            consumers = client.xinfo_consumers(Keys("ray").trajectories, "trainer")
        finally:
            client.close()
    groups_per_step = load_config(ROOT / "configs/quickstart.yaml").trainer.groups_per_step
    assert status["balanced"], status
    assert status["counters"][Counter.GROUPS_TRAINED] == 4 * groups_per_step
    assert status["workers"] == {"rollout": [], "trainer": []}
    # Two ranks in one torch.distributed group, each reading its share as its own consumer.
    assert sorted(c["name"] for c in consumers) == [b"trainer-0", b"trainer-1"], consumers
    for rank in range(2):
        log = (run_dir / "logs" / f"trainer-{rank}.log").read_text()
        assert re.search(rf"trainer trainer-{rank}: step \d+, version \d+, 2 rank\(s\)", log)
