"""`asyncrl agent-server` in process: its protocol (the token, a reward, a failing agent's
reason, a request that does not fit) and `task.agent.type: remote` through a real gateway: an
episode's agent runs on the runner, calling the worker's gateway, and a runner that cannot be
reached is passed over for the next."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from transformers import AutoTokenizer

from asyncrl.agents.config import PythonAgentConfig, RemoteAgentConfig
from asyncrl.agents.runner import make_server
from asyncrl.engines.config import SamplingParams

from episode_helpers import ScriptedEngine
from gateway_helpers import ExactTask, agent_module, config_scheduler, run_groups, tool_model

TOKEN = "s3cret"
AGENT = """
from openai import OpenAI

def solve(item, base_url, api_key):
    if item["prompt"] == "boom":
        raise RuntimeError("the agent broke")
    if item["prompt"] == "offline":
        return 0.5
    client = OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    reply = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": item["prompt"]}]
    )
    return float(reply.choices[0].message.content.strip() == item["answer"])
"""


@pytest.fixture
def runner(user_code: Path) -> Iterator[str]:
    agent_module(user_code, "remote_agent", AGENT)
    cfg = PythonAgentConfig(python_path=[str(user_code)], path="remote_agent:solve")
    httpd = make_server(cfg, token=TOKEN)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_port}"
    finally:
        httpd.shutdown()
        httpd.server_close()


def _episode(prompt: str, **extra: Any) -> dict[str, Any]:
    item = {"id": "p", "prompt": prompt, "answer": "3"}
    return {"item": item, "base_url": "http://127.0.0.1:1/v1", "api_key": "k", **extra}


def test_protocol(runner: str) -> None:
    auth = {"Authorization": f"Bearer {TOKEN}"}
    with httpx.Client(base_url=runner) as http:
        assert http.get("/health").json()["status"] == "ok"  # probes need no token
        body = _episode("offline", timeout_s=5)
        refused = http.post("/v1/episodes", json=body)
        assert refused.status_code == 401 and refused.json()["error"] == "unauthorized"
        wrong = http.post("/v1/episodes", json=body, headers={"Authorization": "Bearer x"})
        assert wrong.status_code == 401
        ok = http.post("/v1/episodes", json=body, headers=auth)
        assert ok.status_code == 200 and ok.json() == {"reward": 0.5}
        broke = http.post("/v1/episodes", json=_episode("boom", timeout_s=5), headers=auth)
        assert broke.status_code == 500
        assert broke.json()["error"] == "agent_error"
        assert "RuntimeError: the agent broke" in broke.json()["detail"]
        unfit = http.post("/v1/episodes", json=_episode("offline"), headers=auth)  # no timeout
        assert unfit.status_code == 400 and unfit.json()["error"] == "malformed"


def test_off_loopback_without_a_token_is_refused(user_code: Path) -> None:
    agent_module(user_code, "remote_agent", AGENT)
    cfg = PythonAgentConfig(python_path=[str(user_code)], path="remote_agent:solve")
    with pytest.raises(ValueError, match="without a token"):
        make_server(cfg, host="0.0.0.0")


class Answers(ScriptedEngine):
    def __init__(self, tokenizer: Any) -> None:
        eos = tokenizer.eos_token_id
        super().__init__([*tokenizer("3", add_special_tokens=False)["input_ids"], eos])


def _closed_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def test_remote_agent_runs_on_the_runner_through_the_gateway(
    runner: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tool_model(tmp_path / "tiny"))
    monkeypatch.setenv("ASYNCRL_AGENT_SERVER_TOKEN", TOKEN)
    cfg = RemoteAgentConfig(type="remote", urls=[_closed_port(), runner], timeout_s=60)
    engine = Answers(tokenizer)
    sched, _ = config_scheduler(engine, tokenizer, cfg, params=SamplingParams(max_new_tokens=8))
    try:
        sched.start("g", ExactTask(tokenizer).item("one plus two?"), 2, "g")
        sched.start("b", ExactTask(tokenizer).item("boom"), 2, "b")
        finished, failed = run_groups(sched, 2)
    finally:
        sched.close()
    (group,) = finished
    assert [s.reward for s in group.samples] == [1.0, 1.0]
    for s in group.samples:
        assert s.meta["calls"] == 1 and s.loss_mask is not None and s.loss_mask.sum() > 0
    (bad,) = failed
    assert bad.reason == "agent_error" and "the agent broke" in bad.detail


def test_no_runner_fails_the_group_by_reason(tmp_path: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tool_model(tmp_path / "tiny"))
    cfg = RemoteAgentConfig(type="remote", urls=[_closed_port(), _closed_port()], start_within_s=0)
    sched, _ = config_scheduler(
        Answers(tokenizer), tokenizer, cfg, params=SamplingParams(max_new_tokens=8)
    )
    try:
        sched.start("g", ExactTask(tokenizer).item("one plus two?"), 1, "g")
        finished, (bad,) = run_groups(sched, 1)
    finally:
        sched.close()
    assert finished == [] and bad.reason == "agent_unavailable"
    assert "no agent runner took it" in bad.detail


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        ([], "give --agent"),
        (["--agent", "nowhere:fn"], "cannot import 'nowhere'"),
        (["--host", "0.0.0.0", "--", "true"], "without a token"),
        (["--agent", "x:y", "--", "true"], "give --agent"),
    ],
)
def test_bad_options_are_one_line_and_exit_2(
    argv: list[str], said: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from asyncrl.cli import main

    monkeypatch.delenv("ASYNCRL_AGENT_SERVER_TOKEN", raising=False)
    assert main(["agent-server", *argv]) == 2
    err = capsys.readouterr().err
    assert said in err and len(err.strip().splitlines()) == 1, err
