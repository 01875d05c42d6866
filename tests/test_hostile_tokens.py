"""Token ids no model can embed, written by an outsider into both streams of a live run.

Trainer and rollout worker are real processes on a real Redis. Each hostile entry (an id at or
past the vocabulary, or a negative one, in a prompt or in a trajectory group) is built with plain
msgpack as any writer with access to Redis could, ends in the dead-letter stream as
`token_out_of_range`, and neither role stops: the run trains to its last step.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

import msgpack
import pytest
import redis

from asyncrl.runstate import Keys
from asyncrl.tiny_model import VOCAB

from role_procs import Role, RoleConfig, step_lines, stop_all, wait_until

V = len(VOCAB)  # the random tiny model's vocabulary: ids 0..V-1


def i32(*values: int) -> bytes:
    return struct.pack(f"<{len(values)}i", *values)


def f32(*values: float) -> bytes:
    return struct.pack(f"<{len(values)}f", *values)


def prompt(run: str, prompt_id: str, ids: bytes) -> dict[str, bytes]:
    message = {
        "schema": 1,
        "run": run,
        "prompt_id": prompt_id,
        "prompt": "",
        "prompt_ids": ids,
        "answer": "",
        "task": "arithmetic",
        "n": 2,
        "release_version": 0,
        "meta": {},
    }
    return {"data": msgpack.packb(message)}


def group(run: str, group_id: str, prompt_ids: bytes, response_ids: bytes) -> dict[str, bytes]:
    def sample(reward: float) -> dict[str, Any]:
        return {
            "response_ids": response_ids,
            "logprobs": f32(-0.5, -0.5),
            "versions": i32(0, 0),
            "reward": reward,
            "finish": "stop",
            "meta": {},
        }

    message = {
        "schema": 1,
        "run": run,
        "group_id": group_id,
        "prompt_id": group_id,
        "release_version": 0,
        "worker": "outsider",
        "created_at": 0.0,
        "finished_at": 0.0,
        "prompt_ids": prompt_ids,
        "samples": [sample(1.0), sample(0.0)],
    }
    return {"data": msgpack.packb(message), "schema": b"1", "min_version": b"0"}


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_out_of_vocabulary_ids_are_dead_lettered_and_both_roles_keep_running(
    redis_client: redis.Redis, tmp_path: Path, role_config: RoleConfig
) -> None:
    keys = Keys("vocab")
    run, max_steps = keys.run_id, 3
    # Queued before the roles start, so that each is read first: on the old code the worker's
    # engine and the trainer's step both died of IndexError on them.
    hostile = {
        keys.prompts: [
            prompt(run, "past-vocab", i32(1, V + 100)),
            prompt(run, "negative", i32(1, -7, 4)),
        ],
        keys.trajectories: [
            group(run, "response-at-vocab", i32(1, 4, 13, 5, 14), i32(4, V)),
            group(run, "negative-prompt", i32(1, -3, 14), i32(4, 2)),
        ],
    }
    added = {
        stream: [redis_client.xadd(stream, f).decode() for f in entries]  # type: ignore[union-attr]
        for stream, entries in hostile.items()
    }
    run_dir = tmp_path / "run"
    config = role_config(
        run,
        {
            "rollout.n": 2,
            "rollout.prompts_per_batch": 2,
            "rollout.sampling.max_new_tokens": 8,
            "trainer.groups_per_step": 2,
            "trainer.max_steps": max_steps,
            "trainer.eval_every": 0,
            "trainer.wait_timeout_s": 120,
            "algo.max_staleness": 4,
            "algo.filter_zero_variance": False,
            "weights.type": "store",
        },
    )
    logs = tmp_path / "logs"
    trainer = Role("trainer", config, logs / "trainer.log")
    worker = Role("rollout", config, logs / "rollout.log", "--worker-id", "w0")
    try:
        wait_until(
            lambda: len(step_lines(run_dir)) >= max_steps,
            300,
            "the run training past the hostile entries",
            [trainer, worker],
        )
        assert trainer.wait(60) == 0, trainer.tail()
        assert worker.alive(), worker.tail()
        assert worker.stop() == 0, worker.tail()
    finally:
        stop_all([trainer, worker])

    dead = {(f[b"stream"].decode(), f[b"id"].decode()): f for _, f in redis_client.xrange(keys.dlq)}
    for stream, ids in added.items():
        for entry_id in ids:
            letter = dead[(stream, entry_id)]
            assert letter[b"reason"] == b"token_out_of_range", letter[b"detail"]
    assert len(dead) == 4  # and nothing else was dead-lettered
    assert (
        f"token id {V + 100} >= vocab size {V}".encode()
        in dead[(keys.prompts, added[keys.prompts][0])][b"detail"]
    )
