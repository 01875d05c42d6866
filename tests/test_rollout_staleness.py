"""The generation side of the staleness bound (DESIGN §5): a group started with weights older
than its prompt's `release_version − η` would start out staler than η, so a rollout worker holds
such a prompt until newer weights arrive. Under `algo.stale_policy: train` (the default) an
episode in flight goes on with new weights, its later tokens carrying the new version; under
`drop` a group in flight whose oldest token falls more than η versions behind the worker's
weights is given up at once, counted dropped stale as the trainer would count it."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import msgpack
import pytest
import redis
from transformers import AutoModelForCausalLM, AutoTokenizer

from asyncrl.protocol import Sample, decode_group
from asyncrl.runstate import PROMPTS_GROUP, Keys, read_accounting
from asyncrl.tasks.build import build_task
from asyncrl.tasks.config import ArithmeticTaskConfig, TaskConfig
from asyncrl.trainer.admission import Admission, Cursor
from asyncrl.trainer.backends import build_publisher
from asyncrl.weights.base import WeightPublisher
from asyncrl.weights.config import StoreWeightsConfig

from role_procs import Role, RoleConfig, stop_all, wait_until

ETA = 1
RELEASED_AT = 3
PROMPTS = 2


SLOW_ENV = """
import asyncio
import os
from asyncrl.environments import StepResult

class Slow:
    def __init__(self, log):
        self.log = log

    async def reset(self, item):
        return None

    async def step(self, response):
        with open(self.log, "a") as f:
            f.write("step\\n")
        await asyncio.sleep(30)
        return StepResult(None, done=True, reward=0.0)

    async def close(self):
        pass


class Gated:
    # Turn 1 waits until the file `gate` exists, then asks for a second turn.

    def __init__(self, log, gate):
        self.log, self.gate, self.turns = log, gate, 0

    async def reset(self, item):
        return None

    async def step(self, response):
        self.turns += 1
        with open(self.log, "a") as f:
            f.write("step\\n")
        while self.turns == 1 and not os.path.exists(self.gate):
            await asyncio.sleep(0.02)
        return StepResult(" then", done=self.turns > 1, reward=0.0)

    async def close(self):
        pass
"""


def _admission_and_publisher(
    client: redis.Redis, keys: Keys, task: TaskConfig, model: Path, store_dir: Path
) -> tuple[Admission, WeightPublisher, dict[str, Any]]:
    """Admission (η = ETA, one group a step) and a store publisher, as the trainer holds them,
    and the model's parameters to publish."""
    admission = Admission(
        client,
        keys,
        build_task(task, AutoTokenizer.from_pretrained(model)),
        task_name=task.type,
        n=2,
        max_staleness=ETA,
        groups_per_step=PROMPTS // (ETA + 1),
        cursor=Cursor(seed=0),
    )
    publisher = build_publisher(
        StoreWeightsConfig(type="store", store_dir=store_dir), client, keys, device="cpu"
    )
    model_params = AutoModelForCausalLM.from_pretrained(model).named_parameters()
    return admission, publisher, dict(model_params)


def _taken(client: redis.Redis, keys: Keys) -> int:
    info = client.xinfo_groups(keys.prompts)
    return sum(int(g["pending"]) for g in info if g["name"].decode() == PROMPTS_GROUP)


def _published_samples(client: redis.Redis, keys: Keys) -> list[Sample]:
    groups = [decode_group(fields[b"data"]) for _, fields in client.xrange(keys.trajectories)]
    return [s for g in groups for s in g.samples]


def _xreadgroup_calls(client: redis.Redis) -> int:
    return int(client.info("commandstats").get("cmdstat_xreadgroup", {}).get("calls", 0))


@pytest.mark.slow
def test_a_worker_holds_prompts_its_weights_are_too_old_for(
    redis_client: redis.Redis, random_model: Path, tmp_path: Path, role_config: RoleConfig
) -> None:
    keys = Keys("genbound")
    store_dir = tmp_path / "weights"
    config = role_config(
        keys.run_id,
        {
            "rollout.n": 2,
            "rollout.sampling.max_new_tokens": 4,
            "algo.max_staleness": ETA,
            "weights.type": "store",
            "weights.store_dir": str(store_dir),
            "weights.sync_timeout_s": 30.0,  # a hold lasts at most 60 s: never reached here
        },
    )
    admission, publisher, params = _admission_and_publisher(
        redis_client, keys, ArithmeticTaskConfig(), random_model, store_dir
    )
    logs = tmp_path / "logs"
    worker = Role("rollout", config, logs / "w.log", "--worker-id", "w")
    try:
        wait_until(
            lambda: bool(redis_client.exists(keys.worker("rollout", "w"))), 180, "start", [worker]
        )
        # Released by a trainer at version 3 to a worker still at version 0: 3 − η > 0.
        assert admission.release(step=0, version=RELEASED_AT) == PROMPTS

        wait_until(lambda: _taken(redis_client, keys) == PROMPTS, 60, "prompts read", [worker])
        reads = _xreadgroup_calls(redis_client)
        time.sleep(2.0)
        assert redis_client.xlen(keys.trajectories) == 0, "generated with weights too old"
        # Holding is waiting for weights, not polling Redis (a 5 ms spin made ~340 reads here).
        assert _xreadgroup_calls(redis_client) - reads < 100
        publisher.publish(params.items(), RELEASED_AT - ETA - 1)
        time.sleep(2.0)
        assert redis_client.xlen(keys.trajectories) == 0, "generated with weights too old"
        publisher.publish(params.items(), RELEASED_AT - ETA)
        wait_until(
            lambda: redis_client.xlen(keys.trajectories) == PROMPTS, 60, "generation", [worker]
        )
        assert worker.stop() == 0, worker.tail()
    finally:
        stop_all([worker])
        publisher.close()

    for sample in _published_samples(redis_client, keys):
        assert sample.versions.min() >= RELEASED_AT - ETA, sample.versions


def _first_turns_at_version_0(
    redis_client: redis.Redis,
    random_model: Path,
    tmp_path: Path,
    role_config: RoleConfig,
    policy: str,
    env: str,
) -> tuple[Keys, WeightPublisher, dict[str, Any], Role]:
    """A worker (η = ETA, stale policy `policy`) whose episodes run `slow_env:{env}`, started,
    given PROMPTS prompts released at version 0, and waited for until every episode has its
    first turn (at version 0) and is inside its environment's step."""
    keys = Keys(f"genbound-mid-{policy}")
    store_dir = tmp_path / "weights"
    steps = tmp_path / "steps.log"
    (tmp_path / "slow_env.py").write_text(SLOW_ENV)
    task = ArithmeticTaskConfig()
    kwargs = {"log": str(steps)} | ({"gate": str(tmp_path / "gate")} if env == "Gated" else {})
    environment = {
        "type": "python",
        "path": f"slow_env:{env}",
        "python_path": [str(tmp_path)],
        "kwargs": kwargs,
    }
    config = role_config(
        keys.run_id,
        {
            "task": {**task.model_dump(), "environment": environment},
            "rollout.n": 2,
            "rollout.sampling.max_new_tokens": 4,
            "algo.max_staleness": ETA,
            "algo.stale_policy": policy,
            "weights.type": "store",
            "weights.store_dir": str(store_dir),
        },
    )
    admission, publisher, params = _admission_and_publisher(
        redis_client, keys, task, random_model, store_dir
    )
    worker = Role("rollout", config, tmp_path / "logs" / "w.log", "--worker-id", "w")
    try:
        wait_until(
            lambda: bool(redis_client.exists(keys.worker("rollout", "w"))), 180, "start", [worker]
        )
        assert admission.release(step=0, version=0) == PROMPTS
        episodes = PROMPTS * 2
        wait_until(
            lambda: steps.exists() and len(steps.read_text().split()) == episodes,
            60,
            "the first turns",
            [worker],
        )
    except BaseException:
        stop_all([worker])
        publisher.close()
        raise
    return keys, publisher, params, worker


@pytest.mark.slow
def test_a_group_fallen_behind_the_bound_mid_episode_is_given_up_under_drop(
    redis_client: redis.Redis, random_model: Path, tmp_path: Path, role_config: RoleConfig
) -> None:
    """`stale_policy: drop`. Episodes whose first turn is generated at version 0, then wait on
    a tool that takes 30 s, while the worker gets version ETA + 1. The trainer would drop them,
    so the worker gives them up then, without waiting out the tool: no trajectory, no dead
    letter, the prompts acked, the groups ended and counted `groups_dropped_stale`, the
    accounts balanced."""
    keys, publisher, params, worker = _first_turns_at_version_0(
        redis_client, random_model, tmp_path, role_config, "drop", "Slow"
    )
    try:
        publisher.publish(params.items(), ETA + 1)
        wait_until(
            lambda: read_accounting(redis_client, keys)[0].groups_dropped_stale == PROMPTS,
            20,  # the tool would answer only after 30 s
            "the groups given up",
            [worker],
        )
        counters, in_flight = read_accounting(redis_client, keys)
        assert in_flight == 0 and counters.is_balanced(in_flight), counters
        assert _taken(redis_client, keys) == 0
        assert redis_client.xlen(keys.trajectories) == 0
        assert redis_client.xlen(keys.dlq) == 0
        assert worker.stop() == 0, worker.tail()
    finally:
        stop_all([worker])
        publisher.close()


@pytest.mark.slow
def test_under_the_default_policy_an_episode_goes_on_with_new_weights(
    redis_client: redis.Redis, random_model: Path, tmp_path: Path, role_config: RoleConfig
) -> None:
    """`stale_policy: train`. The same first turns at version 0; the worker takes version
    ETA + 1 while the tool runs, then the tool answers: nothing is given up, the second turns
    are generated with the new weights and every group is published, its samples' versions
    stepping from 0 to ETA + 1 — a group staler than η, for the trainer to train."""
    keys, publisher, params, worker = _first_turns_at_version_0(
        redis_client, random_model, tmp_path, role_config, "train", "Gated"
    )
    try:
        publisher.publish(params.items(), ETA + 1)
        beat = keys.worker("rollout", "w")
        wait_until(
            lambda: msgpack.unpackb(redis_client.get(beat) or b"\x80").get("version") == ETA + 1,
            60,
            "the new weights in the engine",
            [worker],
        )
        (tmp_path / "gate").touch()
        wait_until(
            lambda: redis_client.xlen(keys.trajectories) == PROMPTS, 60, "the groups", [worker]
        )
        counters, _ = read_accounting(redis_client, keys)
        assert counters.groups_dropped_stale == 0 and counters.groups_published == PROMPTS
        assert redis_client.xlen(keys.dlq) == 0
        assert worker.stop() == 0, worker.tail()
    finally:
        stop_all([worker])
        publisher.close()
    for sample in _published_samples(redis_client, keys):
        assert sample.versions.min() == 0 and sample.versions.max() == ETA + 1, sample.versions
