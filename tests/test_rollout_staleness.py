"""The generation side of the staleness bound (DESIGN §5): a group generated with weights older
than its prompt's `release_version − η` would surely be dropped by the trainer, so a rollout
worker holds such a prompt until newer weights arrive instead of wasting its generation."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import redis
from transformers import AutoModelForCausalLM, AutoTokenizer

from asyncrl.protocol import decode_group
from asyncrl.runstate import PROMPTS_GROUP, Keys
from asyncrl.tasks.base import build_task
from asyncrl.tasks.config import ArithmeticTaskConfig
from asyncrl.trainer.admission import Admission, Cursor
from asyncrl.weights import StoreWeightsConfig, build_publisher

from role_procs import Role, RoleConfig, stop_all, wait_until

ETA = 1
RELEASED_AT = 3
PROMPTS = 2


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
    admission = Admission(
        redis_client,
        keys,
        build_task(ArithmeticTaskConfig(), AutoTokenizer.from_pretrained(random_model)),
        task_name="arithmetic",
        n=2,
        max_staleness=ETA,
        groups_per_step=PROMPTS // (ETA + 1),
        cursor=Cursor(seed=0),
    )
    publisher = build_publisher(
        StoreWeightsConfig(type="store", store_dir=store_dir), redis_client, keys, device="cpu"
    )
    params = dict(AutoModelForCausalLM.from_pretrained(random_model).named_parameters())
    logs = tmp_path / "logs"
    worker = Role("rollout", config, logs / "w.log", "--worker-id", "w")
    try:
        wait_until(
            lambda: bool(redis_client.exists(keys.worker("rollout", "w"))), 180, "start", [worker]
        )
        # Released by a trainer at version 3 to a worker still at version 0: 3 − η > 0.
        assert admission.release(step=0, version=RELEASED_AT) == PROMPTS

        def taken() -> int:
            info = redis_client.xinfo_groups(keys.prompts)
            return sum(int(g["pending"]) for g in info if g["name"].decode() == PROMPTS_GROUP)

        wait_until(lambda: taken() == PROMPTS, 60, "the worker reading the prompts", [worker])
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

    for _, fields in redis_client.xrange(keys.trajectories):
        for sample in decode_group(fields[b"data"]).samples:
            assert sample.versions.min() >= RELEASED_AT - ETA, sample.versions
