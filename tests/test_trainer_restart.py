"""A trainer SIGKILLed between checkpoints resumes from the last one (DESIGN §5, §9).

Trainer and rollout worker run as separate processes on a real Redis. The trainer is killed after
step 4 with its checkpoint at step 3, then restarted: it resumes at step 4, publishes its restored
weights under a new version, re-reads the entries it held, and the run ends with every surviving
step's groups counted trained exactly once and the run accounting balanced.
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import redis

from asyncrl.launch.status import collect_status
from asyncrl.protocol import stream_fields
from asyncrl.runstate import TRAJECTORIES_GROUP, Counter, Keys
from asyncrl.trainer.checkpoint import list_checkpoints

from role_procs import Role, RoleConfig, pending_groups, step_lines, stop_all, wait_until
from sample_groups import plain_group

if TYPE_CHECKING:
    from asyncrl.config import Config
    from asyncrl.trainer.checkpoint import TrainerState

G = 4
CKPT_EVERY = 3
MAX_STEPS = 8
KILL_AFTER = 4


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_trainer_killed_between_checkpoints_resumes(
    redis_client: redis.Redis, tmp_path: Path, role_config: RoleConfig
) -> None:
    run_dir = tmp_path / "run"
    keys = Keys("restart")
    config = role_config(
        keys.run_id,
        {
            "rollout.n": 4,
            "rollout.prompts_per_batch": 2,
            "rollout.heartbeat_ttl_s": 2.0,
            "rollout.sampling.max_new_tokens": 16,
            "trainer.groups_per_step": G,
            "trainer.max_steps": MAX_STEPS,
            "trainer.checkpoint_every": CKPT_EVERY,
            "trainer.keep_checkpoints": 5,
            # An evaluation after every step (written after the step line) holds the trainer
            # for a while, so the kill lands after step 4 and well before the step-6 checkpoint.
            "trainer.eval_every": 1,
            "trainer.eval_size": 500,
            "trainer.wait_timeout_s": 120,
            "algo.max_staleness": 3,
            "algo.filter_zero_variance": False,
            "weights.type": "broadcast",
        },
    )
    logs = tmp_path / "logs"
    worker = Role("rollout", config, logs / "rollout.log", "--worker-id", "w0")
    first = Role("trainer", config, logs / "trainer-1.log")
    second: Role | None = None
    try:
        wait_until(
            lambda: len(step_lines(run_dir)) >= KILL_AFTER,
            240,
            f"trainer reaching step {KILL_AFTER}",
            [worker, first],
        )
        first.kill()
        before = step_lines(run_dir)
        killed_at = before[-1]["step"]
        ckpts = list_checkpoints(run_dir / "checkpoints")
        ckpt_step = int(ckpts[-1].name.removeprefix("step_"))
        # The premise: killed between checkpoints, with trained steps the checkpoint lacks.
        assert ckpt_step == CKPT_EVERY < killed_at < 2 * CKPT_EVERY, (ckpt_step, killed_at)
        held = pending_groups(redis_client, keys)
        assert len(held) >= (killed_at - ckpt_step) * G  # unacked: no checkpoint holds them
        counters = collect_status(redis_client, keys, run_dir)["counters"]
        assert counters[Counter.GROUPS_TRAINED] == ckpt_step * G
        published_at_kill = int(redis_client.get(keys.version) or -1)
        assert published_at_kill == before[-1]["version"]

        second = Role("trainer", config, logs / "trainer-2.log")
        assert second.wait(300) == 0, second.tail()
        worker.stop()
    finally:
        stop_all(r for r in (worker, first, second) if r is not None)

    after = step_lines(run_dir)[len(before) :]
    # Resumed at the checkpoint's step, ran to the end.
    assert [s["step"] for s in after] == list(range(ckpt_step + 1, MAX_STEPS + 1))
    # Restored weights were published as a new version, then one more per step.
    log = (logs / "trainer-2.log").read_text()
    match = re.search(r"trainer trainer-0: step (\d+), version (\d+)", log)
    assert match is not None, log[-3000:]
    assert (int(match[1]), int(match[2])) == (ckpt_step, published_at_kill + 1)
    versions = [s["version"] for s in after]
    assert versions == list(range(published_at_kill + 2, published_at_kill + 2 + len(after)))
    assert min(versions) > max(s["version"] for s in before)

    # The entries the killed trainer held were re-read: none is pending or dead-lettered now.
    assert not held & pending_groups(redis_client, keys)
    assert redis_client.xlen(keys.dlq) == 0
    status = collect_status(redis_client, keys, run_dir)
    counters, streams = status["counters"], status["streams"]
    # Each step of the surviving lineage (1-3 before the kill, 4-8 after) acked its groups once.
    assert counters[Counter.GROUPS_TRAINED] == MAX_STEPS * G
    assert streams["trajectories"]["pending"] == 0
    assert status["balanced"], status
    traj = streams["trajectories"]
    assert counters[Counter.GROUPS_PUBLISHED] == (
        counters[Counter.GROUPS_TRAINED] + counters[Counter.GROUPS_DROPPED_STALE] + traj["lag"]
    )
    final = list_checkpoints(run_dir / "checkpoints")[-1]
    assert final.name == f"step_{MAX_STEPS:08d}"


def _trainer_config(role_config: RoleConfig, run_id: str, settings: dict[str, Any]) -> Config:
    """The config of an in-process trainer: on CPU, weights through the store (no group for
    workers to form), `settings` added."""
    from asyncrl.config import load_config

    base = {"weights.type": "store", "trainer.device": "cpu", "rollout.n": 2}
    return load_config(role_config(run_id, {**base, **settings}))


def _checkpoint(run_dir: Path, random_model: Path, state: TrainerState) -> Path:
    """A checkpoint at `state` of the seed-0 tiny model, with a fresh optimizer's state."""
    import torch

    from asyncrl.tiny_model import new_tiny_model
    from asyncrl.trainer.checkpoint import save_checkpoint
    from asyncrl.trainer.parallel import full_state

    model = new_tiny_model(seed=0)
    optimizer = torch.optim.AdamW(model.parameters())
    return save_checkpoint(
        run_dir / "checkpoints",
        model,
        *full_state(model, optimizer),
        state,
        tokenizer_dir=random_model,
        keep=2,
    )


def test_sigterm_while_collecting_leaves_the_partial_step_pending(
    redis_client: redis.Redis, tmp_path: Path, role_config: RoleConfig
) -> None:
    """A trainer told to stop halfway through collecting a step checkpoints what it trained and
    leaves the groups of the unfinished step pending, for the restarted trainer to train on —
    it must not ack them as trained."""
    from asyncrl.trainer.main import Trainer

    keys = Keys("stop")
    cfg = _trainer_config(
        role_config,
        keys.run_id,
        {
            "trainer.groups_per_step": 2,
            "trainer.checkpoint_every": 1,
            "trainer.wait_timeout_s": 60,
        },
    )
    redis_client.hset(keys.released, mapping={"a": "", "b": ""})  # as admission would
    first_id = redis_client.xadd(keys.trajectories, stream_fields(plain_group("a"))).decode()
    trainer = Trainer(cfg)

    def stop_once_held() -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not pending_groups(redis_client, keys):
            time.sleep(0.02)
        os.kill(os.getpid(), signal.SIGTERM)

    previous = signal.getsignal(signal.SIGTERM)
    stopper = threading.Thread(target=stop_once_held, daemon=True)
    stopper.start()
    try:
        assert trainer.run() == 0
    finally:
        stopper.join()
        signal.signal(signal.SIGTERM, previous)
        trainer.client.close()
    assert trainer.step == 0
    assert pending_groups(redis_client, keys) == {first_id}
    counters = collect_status(redis_client, keys, tmp_path / "run")["counters"]
    assert counters[Counter.GROUPS_TRAINED] == 0

    # The restarted trainer trains on it.
    second_id = redis_client.xadd(keys.trajectories, stream_fields(plain_group("b"))).decode()
    restarted = Trainer(cfg)
    try:
        groups, _, ids = restarted._collect()
    finally:
        restarted.close()
    assert ids == [first_id, second_id]
    assert [g.group_id for g in groups] == ["a", "b"]


def test_restart_acks_every_ranks_covered_entries_once(
    redis_client: redis.Redis, random_model: Path, tmp_path: Path, role_config: RoleConfig
) -> None:
    """A 2-rank trainer died after its checkpoint was durable but before the ranks acked the
    entries it covers. The restarted trainer — one rank now — acks both ranks' lists as trained,
    leaves the entry of the unfinished step pending, and a second restart counts nothing twice."""
    from asyncrl.trainer.checkpoint import TrainerState
    from asyncrl.trainer.main import Trainer

    keys = Keys("covered")
    run_dir = tmp_path / "run"
    ids = [
        redis_client.xadd(keys.trajectories, stream_fields(plain_group(f"g{i}"))).decode()
        for i in range(5)
    ]
    # As if released and generated: the accounting balances with the entries pending.
    redis_client.hset(keys.counters, Counter.PROMPTS_RELEASED, len(ids))
    redis_client.hset(keys.released, mapping={f"g{i}": "" for i in range(len(ids))})
    redis_client.xgroup_create(keys.trajectories, TRAJECTORIES_GROUP, id="0")
    for consumer, n in (("trainer-0", 2), ("trainer-1", 3)):
        redis_client.xreadgroup(TRAJECTORIES_GROUP, consumer, {keys.trajectories: ">"}, count=n)
    covered = {"trainer-0": ids[:2], "trainer-1": ids[2:4]}  # ids[4]: the unfinished step's
    _checkpoint(
        run_dir,
        random_model,
        TrainerState(step=2, version=2, cursor={"seed": 0}, wall_seconds=1.0, covered=covered),
    )
    cfg = _trainer_config(
        role_config,
        keys.run_id,
        # Nothing left to train: restore, ack, leave.
        {"trainer.max_steps": 2, "trainer.checkpoint_every": 1},
    )
    previous = signal.getsignal(signal.SIGTERM)
    try:
        for _ in range(2):
            trainer = Trainer(cfg)
            try:
                assert trainer.run() == 0
            finally:
                trainer.client.close()
            status = collect_status(redis_client, keys, run_dir)
            assert status["counters"][Counter.GROUPS_TRAINED] == 4
            assert pending_groups(redis_client, keys) == {ids[4]}
            assert status["balanced"], status
    finally:
        signal.signal(signal.SIGTERM, previous)


@pytest.mark.parametrize("published_after", [None, 27])
def test_a_trainer_resumed_against_an_empty_redis_never_reuses_a_version(
    redis_client: redis.Redis,
    random_model: Path,
    tmp_path: Path,
    published_after: int | None,
    role_config: RoleConfig,
) -> None:
    """Redis lost its data, `version` key included; the checkpoint's weights went out as version
    24, so the restored weights are published as 25 (not 0: workers holding 24 would take 0..24
    for versions they have seen) — or, where the trainer that died had published up to 27 after
    that checkpoint, as 28: the run directory's record remembers what Redis forgot."""
    from asyncrl.trainer.checkpoint import TrainerState, record_version
    from asyncrl.trainer.main import Trainer

    keys = Keys("empty")
    run_dir = tmp_path / "run"
    _checkpoint(
        run_dir,
        random_model,
        TrainerState(step=24, version=24, cursor={"seed": 0}, wall_seconds=1.0),
    )
    if published_after is not None:
        record_version(run_dir / "checkpoints", published_after)
    expected = 1 + (24 if published_after is None else published_after)
    assert redis_client.dbsize() == 0
    # Nothing left to train: restore, publish, leave.
    cfg = _trainer_config(role_config, keys.run_id, {"trainer.max_steps": 24})
    previous = signal.getsignal(signal.SIGTERM)
    try:
        trainer = Trainer(cfg)
        try:
            assert trainer.version == expected
            assert trainer.run() == 0
        finally:
            trainer.client.close()
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert int(redis_client.get(keys.version)) == expected  # type: ignore[arg-type]
    assert redis_client.hget(keys.weights, "store_version") == str(expected).encode()


def _checkpoint_at_step_10(run_dir: Path, random_model: Path, **state: object) -> Path:
    """A checkpoint of a run that trained 10 steps of 8 groups."""

    from asyncrl.trainer.checkpoint import TrainerState

    return _checkpoint(
        run_dir,
        random_model,
        TrainerState(
            step=10,
            version=10,
            cursor={"seed": 0, "epoch": 0, "position": 96},
            wall_seconds=1.0,
            **state,  # type: ignore[arg-type]
        ),
    )


@pytest.mark.parametrize("new_g", [4, 32])
def test_resuming_with_another_groups_per_step_rebases_the_budget(
    redis_client: redis.Redis,
    random_model: Path,
    tmp_path: Path,
    role_config: RoleConfig,
    new_g: int,
) -> None:
    """A run of G = 8, η = 1 checkpointed at step 10: 80 groups consumed, 96 released, 16 in
    flight. Resumed with another G, the bound is (η + 1) × G on the new G from the 80 consumed:
    with 4, nothing is released until the 16 in flight are trained and then 8 (not a budget
    negative for good); with 32, 48 at once and one step's 32 per step (not 288)."""
    from asyncrl.trainer.main import Trainer

    keys = Keys(f"regroup{new_g}")
    _checkpoint_at_step_10(tmp_path / "run", random_model, groups_consumed=80)
    redis_client.hset(
        keys.counters,
        mapping={Counter.PROMPTS_RELEASED: 96, Counter.GROUPS_TRAINED: 80},
    )
    redis_client.hset(keys.released, mapping={f"g{i}": "" for i in range(16)})
    cfg = _trainer_config(
        role_config, keys.run_id, {"trainer.groups_per_step": new_g, "algo.max_staleness": 1}
    )
    trainer = Trainer(cfg)
    try:
        assert trainer.rank0 is not None
        admission = trainer.rank0.admission
        released = 96
        for step in (10, 11, 14):
            released += admission.release(step, trainer.version)
            consumed = 80 + (step - 10) * new_g
            assert released == max(96, consumed + 2 * new_g), step
            assert admission.groups_consumed(step) == consumed
    finally:
        trainer.close()


@pytest.mark.parametrize(
    "change, key",
    [("model", "model.path"), ("task", "task.digits")],
)
def test_resuming_with_another_model_or_task_is_refused(
    random_model: Path, tmp_path: Path, role_config: RoleConfig, change: str, key: str
) -> None:
    """The checkpoint's weights must fit model.path (its tokenizer, reference and the workers'
    engines come from there) and its data cursor walks the run's own task: a resume with
    another is refused before anything of the run is touched, in one line naming the key."""
    import json

    from asyncrl.config import load_config

    from role_procs import asyncrl

    config = role_config("refused", {"weights.type": "store", "trainer.device": "cpu"})
    task = load_config(config).task.model_dump(mode="json")
    saved = _checkpoint_at_step_10(
        tmp_path / "run", random_model, task={**task, "digits": 3} if change == "task" else task
    )
    if change == "model":  # the checkpoint of a deeper copy of the model
        spec = json.loads((saved / "config.json").read_text())
        spec["num_hidden_layers"] += 1
        (saved / "config.json").write_text(json.dumps(spec))

    done = asyncrl("launch", "--role", "trainer", "--config", str(config), timeout=120)
    assert done.returncode == 2, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("asyncrl: config error: ") and key in last, last
