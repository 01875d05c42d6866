"""A remote agent runner (`asyncrl agent-server`, `task.agent.type: remote`) through a real
rollout worker and trainer, SIGKILLed mid-episode once and restarted on its port: the groups
it had in flight are dead-lettered by reason (`agent_unavailable`), those that began while it
was down wait for it (`start_within_s`), the run still trains every step's groups once (it
needs the restarted runner to finish: there is no other), and the counters balance."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
from pathlib import Path

import pytest
import redis

from asyncrl.launch.redis_server import RedisServer
from asyncrl.launch.status import collect_status
from asyncrl.runstate import Counter, Keys
from asyncrl.web.serving import spawn_cli

from gateway_helpers import agent_module, agent_run_settings, tool_model
from role_procs import Role, dead_letters, stop_all, wait_until, write_role_config

STEPS, G, N = 2, 2, 2

AGENT = """
import os, time
from openai import OpenAI

def solve(item, base_url, api_key, log):
    client = OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    reply = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": item["prompt"]}], max_tokens=4
    )
    try:
        fd = os.open(os.path.join(log, "victim.lock"), os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return float(reply.choices[0].message.content.strip() == item["answer"])
    os.close(fd)  # the first to get here waits, its call made, for the test's SIGKILL
    with open(os.path.join(log, "victim.tmp"), "w") as f:
        f.write(str(os.getpid()))
    os.rename(os.path.join(log, "victim.tmp"), os.path.join(log, "victim.pid"))
    time.sleep(600)
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_remote_agent_runner_killed_mid_episode(
    redis_server: RedisServer, redis_client: redis.Redis, tmp_path: Path, user_code: Path
) -> None:
    agent_module(user_code, "runner_agent", AGENT)
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    port = _free_port()
    args = [
        "agent-server",
        "--agent",
        "runner_agent:solve",
        "--python-path",
        str(user_code),
        "--kwargs",
        f'{{"log": "{user_code}"}}',
        "--port",
        str(port),
        "--token-file",
        str(token),
    ]
    runners: list[subprocess.Popen[str]] = [spawn_cli(args)[0]]
    model = tool_model(tmp_path / "model")
    keys = Keys("remote-agent-e2e")
    redis_client.xgroup_create(keys.trajectories, "probe", id="0", mkstream=True)
    config = write_role_config(
        tmp_path,
        redis_server.url,
        model,
        keys.run_id,
        {
            **agent_run_settings(STEPS, G, N),
            "task.agent.type": "remote",
            "task.agent.urls": [f"http://127.0.0.1:{port}"],
            "task.agent.token_file": str(token),
            "task.agent.timeout_s": 240,
            # Episodes wait for the runner to come back: only those it had begun are lost.
            "task.agent.start_within_s": 200,
        },
    )
    logs = tmp_path / "logs"
    roles = [
        Role("trainer", config, logs / "trainer.log"),
        Role("rollout", config, logs / "w0.log", "--worker-id", "w0"),
    ]
    trainer, worker = roles
    victim = user_code / "victim.pid"
    try:
        wait_until(victim.exists, 240, "an agent mid-episode on the runner", roles)
        assert int(victim.read_text()) == runners[0].pid
        os.kill(runners[0].pid, signal.SIGKILL)
        runners[0].wait()
        runners.append(spawn_cli(args)[0])  # the same port: the run needs it back
        assert trainer.wait(300) == 0, trainer.tail()
        assert worker.stop() == 0, worker.tail()
    finally:
        stop_all(roles)
        for proc in runners:
            proc.kill()
            proc.wait()

    status = collect_status(redis_client, keys, tmp_path / "run")
    counters = status["counters"]
    assert status["balanced"] is True, status
    assert counters[Counter.GROUPS_TRAINED] == STEPS * G  # each step's groups acked once
    assert status["streams"]["trajectories"]["pending"] == 0
    letters = dead_letters(redis_server.url, keys.run_id)
    assert letters, letters
    for reason, detail in letters:  # the episodes the runner had begun, no others
        assert reason == "agent_unavailable" and "went away mid-episode" in detail, detail
