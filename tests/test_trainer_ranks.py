"""Trainer ranks stop together and checkpoint every rank's entries (DESIGN §9).

Two real trainer ranks (gloo, started as torchrun starts them) train on groups fed straight into
the trajectories stream. A SIGTERM to one rank while both wait for data — the case where a rank
that left on its own stranded the other — stops both: both exit 0, the final checkpoint holds
every trained step and both ranks' entry ids, the half-collected step stays pending, and a
restart trains it. With `trainer.parallel=fsdp` the same run publishes, checkpoints and restores
a sharded model, and with `model.lora` (and gradient checkpointing) a sharded adapter.
"""

from __future__ import annotations

import json
import signal
import socket
import time
from pathlib import Path

import pytest
import redis
import torch

from asyncrl.config import ConfigError, load_config
from asyncrl.launch.status import collect_status
from asyncrl.protocol import stream_fields
from asyncrl.runstate import Counter, Keys
from asyncrl.trainer.checkpoint import list_checkpoints

from role_procs import Role, RoleConfig, pending_groups, step_lines, stop_all, wait_until
from sample_groups import plain_group

G = 4
STEPS = 3


def start_ranks(config: Path, logs: Path, monkeypatch: pytest.MonkeyPatch) -> list[Role]:
    """Two `asyncrl launch --role trainer` ranks with torchrun's environment."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    logs.mkdir(exist_ok=True)
    ranks = []
    for rank in range(2):
        with monkeypatch.context() as env:  # Role hands its environment to the child
            for name, value in [
                ("RANK", rank),
                ("LOCAL_RANK", rank),
                ("WORLD_SIZE", 2),
                ("MASTER_ADDR", "127.0.0.1"),
                ("MASTER_PORT", port),
            ]:
                env.setenv(name, str(value))
            ranks.append(Role("trainer", config, logs / f"trainer-{rank}.log"))
    return ranks


def covered(run_dir: Path) -> tuple[int, dict[str, list[str]]]:
    """Step and covered ids of the newest checkpoint."""
    ckpt = list_checkpoints(run_dir / "checkpoints")[-1]
    state = json.loads((ckpt / "trainer_state.json").read_text())
    assert ckpt.name == f"step_{state['step']:08d}"
    return state["step"], state["covered"]


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    ("parallel", "signalled", "lora"),
    [("ddp", (1,), False), ("fsdp", (1, 0), False), ("fsdp", (1,), True)],
)
def test_sigterm_to_one_rank_stops_all_ranks(
    parallel: str,
    signalled: tuple[int, ...],
    lora: bool,
    redis_client: redis.Redis,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    role_config: RoleConfig,
) -> None:
    run_dir = tmp_path / "run"
    keys = Keys(f"ranks-{parallel}{'-lora' if lora else ''}")
    settings = {
        "redis.block_ms": 200,
        "weights.type": "store",
        "rollout.n": 2,
        "trainer.device": "cpu",
        "trainer.parallel": parallel,
        "trainer.groups_per_step": G,
        "trainer.max_steps": 100,
        # Every step's ids stay unacked until the final checkpoint, which must hold them all.
        "trainer.checkpoint_every": 100,
        "trainer.eval_every": 0,
        "trainer.wait_timeout_s": 300,
        "algo.max_staleness": 100,
    }
    if lora:
        settings |= {"model.lora.rank": 4, "trainer.gradient_checkpointing": True}
    config = role_config(keys.run_id, settings)

    def feed(n: int, start: int = 0) -> list[str]:
        gids = [f"g{i}" for i in range(start, start + n)]
        redis_client.hset(keys.released, mapping=dict.fromkeys(gids, ""))  # as admission would
        return [
            redis_client.xadd(keys.trajectories, stream_fields(plain_group(gid))).decode()
            for gid in gids
        ]

    ids = feed(STEPS * G + 1)
    ranks = start_ranks(config, tmp_path / "logs-1", monkeypatch)
    try:
        # Three steps trained (all entries unacked until a checkpoint) and the spare entry read:
        # both ranks now wait in the fourth step's collection, one with half its share.
        wait_until(
            lambda: (
                len(step_lines(run_dir)) == STEPS
                and len(pending_groups(redis_client, keys)) == len(ids)
            ),
            300,
            f"{STEPS} steps and the spare entry read",
            ranks,
        )
        time.sleep(1.0)
        for rank in signalled:
            if ranks[rank].alive():
                ranks[rank].proc.send_signal(signal.SIGTERM)
            time.sleep(0.3)
        assert [r.wait(60) for r in ranks] == [0, 0], "\n".join(r.tail() for r in ranks)
    finally:
        stop_all(ranks)

    assert len(step_lines(run_dir)) == STEPS
    step, ids_by_rank = covered(run_dir)
    assert step == STEPS
    assert sorted(ids_by_rank) == ["trainer-0", "trainer-1"]
    assert all(len(v) == STEPS * G // 2 for v in ids_by_rank.values())
    assert set(ids_by_rank["trainer-0"]) | set(ids_by_rank["trainer-1"]) == set(ids[:-1])
    # Trained steps acked once their checkpoint was durable; the unfinished step's entry waits.
    assert pending_groups(redis_client, keys) == {ids[-1]}
    counters = collect_status(redis_client, keys, run_dir)["counters"]
    assert counters[Counter.GROUPS_TRAINED] == STEPS * G
    saved = torch.load(list_checkpoints(run_dir / "checkpoints")[-1] / "optimizer.pt")
    if lora:  # the adapter's state alone, full tensors keyed by name
        assert saved["state"] and all(".lora_" in name for name in saved["state"])
    else:
        assert "model.embed_tokens.weight" in saved["state"]  # full state, keyed by name

    # Restarted, the ranks restore the checkpoint (sharded or not), train the pending entry in
    # the next step and stop at max_steps.
    role_config(
        keys.run_id,
        {**settings, "trainer.max_steps": STEPS + 1},
    )
    more = feed(G - 1, len(ids))
    ranks = start_ranks(config, tmp_path / "logs-2", monkeypatch)
    try:
        assert [r.wait(300) for r in ranks] == [0, 0], "\n".join(r.tail() for r in ranks)
    finally:
        stop_all(ranks)
    assert [s["step"] for s in step_lines(run_dir)] == list(range(1, STEPS + 2))
    step, ids_by_rank = covered(run_dir)
    assert step == STEPS + 1
    assert {i for v in ids_by_rank.values() for i in v} == {ids[-1], *more}
    status = collect_status(redis_client, keys, run_dir)
    counters, traj = status["counters"], status["streams"]["trajectories"]
    assert traj["pending"] == traj["lag"] == 0
    assert counters[Counter.GROUPS_TRAINED] == (STEPS + 1) * G == len(ids) + len(more)


def test_fsdp_needs_evaluation_off() -> None:
    with pytest.raises(ConfigError, match=r"trainer\.eval_every"):
        load_config(None, ["trainer.parallel=fsdp"])
    assert load_config(None, ["trainer.parallel=fsdp", "trainer.eval_every=0"])
