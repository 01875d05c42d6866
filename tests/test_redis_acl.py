"""A run works with a Redis user limited to the run's keys and to commands outside @dangerous.

A run-scoped ACL user (`+@all -@dangerous ~asyncrl:<run>:* &asyncrl:<run>:*`, as SECURITY.md
gives it) is what a shared Redis hands each run: no command that lists, configures or flushes the
server, no key of another run. A real trainer and rollout worker, both connected as that user,
train a few steps; `asyncrl status` reads the run back as that user.
"""

from __future__ import annotations

import json
import secrets
from pathlib import Path

import pytest
import redis

from asyncrl.launch.redis_server import RedisServer, write_secret
from asyncrl.runstate import Keys

from role_procs import (
    SMALL_RUN,
    Role,
    asyncrl,
    step_lines,
    stop_all,
    trainer_and_worker,
    wait_until,
    write_role_config,
)

USER = "run-acl"
KEYS = Keys("acl")


def acl_rule(keys: Keys) -> str:
    """The ACL of a run's user, as SECURITY.md gives it."""
    return f"~{keys.prefix}* &{keys.prefix}* +@all -@dangerous"


def run_config(tmp_path: Path, server: RedisServer, password: str, model: Path) -> Path:
    """A quickstart-shaped run of two roles that connect to `server` as `USER`."""
    secret = tmp_path / "redis-password"
    write_secret(secret, password)
    return write_role_config(
        tmp_path,
        server.url.replace("redis://", f"redis://{USER}@"),
        model,
        KEYS.run_id,
        {"redis.password_file": str(secret), **SMALL_RUN},
    )


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_run_trains_as_a_user_limited_to_its_keys_and_to_commands_outside_dangerous(
    random_model: Path, tmp_path: Path
) -> None:
    password = "pw-" + secrets.token_hex(12)
    server = RedisServer(
        data_dir=tmp_path / "redis",
        extra_args=["--user", USER, "on", f">{password}", *acl_rule(KEYS).split()],
    ).start()
    admin = redis.Redis.from_url(server.url)  # the default user: the test's own view
    run_dir = tmp_path / "run"
    config = run_config(tmp_path, server, password, random_model)
    roles = trainer_and_worker(config, tmp_path / "logs")
    trainer, worker = roles
    try:
        wait_until(lambda: len(step_lines(run_dir)) >= 3, 300, "three steps", roles)
        status = asyncrl("status", "--json", "--config", str(config))
        assert worker.stop() == 0, worker.tail()
        assert trainer.stop() == 0, trainer.tail()
        denied = admin.acl_log()
    finally:
        stop_all(roles)
        admin.close()
        server.stop()
    assert status.returncode == 0, status.stderr
    assert json.loads(status.stdout)["last_step"]["step"] >= 3
    # INFO is the one command refused: the memory gauge goes without it, saying so once.
    assert {entry["object"] for entry in denied} == {"info"}, denied
    assert {entry["reason"] for entry in denied} == {"command"}, denied
    for role in roles:
        text = role.log.read_text()
        assert "Traceback" not in text, role.tail()
        assert text.count("this user may not run INFO") <= 1, role.tail()


def test_a_user_whose_acl_forgets_the_runs_channels_stops_the_trainer_with_one_line(
    random_model: Path, tmp_path: Path
) -> None:
    # Redis 7 gives a new user no pub/sub channel: the weights doorbell is refused.
    password = "pw-" + secrets.token_hex(12)
    rule = f"~{KEYS.prefix}* +@all -@dangerous"
    server = RedisServer(
        data_dir=tmp_path / "redis",
        extra_args=["--user", USER, "on", f">{password}", *rule.split()],
    ).start()
    try:
        config = run_config(tmp_path, server, password, random_model)
        trainer = Role("trainer", config, tmp_path / "trainer.log")
        rc = trainer.wait(300)
    finally:
        server.stop()
    out = trainer.log.read_text()
    assert rc == 2, out
    assert "Traceback" not in out, out
    refused = [line for line in out.splitlines() if "the ACL refused this user" in line]
    assert len(refused) == 1 and "channel" in refused[0], out
