"""Agents people already have, in process over a real gateway: the OpenAI Agents SDK with a
function tool on its default Responses model (examples/agents_sdk), a LangGraph ReAct agent
(examples/langgraph_agent), and command agents — a bash + curl + jq script
(examples/command_agent) and commands that fail, print no reward or outlive their time, whose
groups fail by reason with their stderr, their process groups killed. The engine is scripted: it
calls the `add` tool until the prompt holds a tool result, then answers "3"."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from asyncrl.agents.config import CommandAgentConfig
from asyncrl.engines.base import Generation
from asyncrl.engines.config import SamplingParams
from asyncrl.reasons import GroupReason
from asyncrl.rollout.groups import FinishedGroup

from episode_helpers import ScriptedEngine
from gateway_helpers import (
    CALL_TEXT,
    ExactTask,
    agent_scheduler,
    config_scheduler,
    dies,
    run_groups,
    tool_model,
)

PARAMS = SamplingParams(max_new_tokens=64)
EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return AutoTokenizer.from_pretrained(tool_model(tmp_path_factory.mktemp("tools") / "tiny"))


class ToolThenAnswer(ScriptedEngine):
    """Calls `add` while the prompt holds no tool result, then answers "3"."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        eos = tokenizer.eos_token_id
        self.call = [*tokenizer(CALL_TEXT, add_special_tokens=False)["input_ids"], eos]
        self.answer = [*tokenizer("3", add_special_tokens=False)["input_ids"], eos]
        super().__init__(self.call)

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        out = []
        for prompt in prompts:
            self.reply = self.answer if "tool:" in self.tokenizer.decode(prompt) else self.call
            out += super().generate([prompt], params)
        return out


def _one_group(sched: Any, tokenizer: Any, n: int) -> tuple[list[Any], list[Any]]:
    try:
        sched.start("g", ExactTask(tokenizer).item("one plus two?"), n, "g")
        return run_groups(sched, 1)
    finally:
        sched.close()


def _check_tool_episodes(group: FinishedGroup[str], engine: ToolThenAnswer, n: int) -> None:
    """Each episode: the tool call, then the answer after its result, in one sample."""
    assert len(group.samples) == n
    for s in group.samples:
        assert s.reward == 1.0 and s.meta["calls"] == 2
        assert s.loss_mask is not None
        trained = s.response_ids[s.loss_mask == 1].tolist()
        assert trained == engine.call + engine.answer
        assert (s.logprobs[s.loss_mask == 1] == -0.5).all()
        assert (s.logprobs[s.loss_mask == 0] == 0).all()


def _run_example(tokenizer: Any, folder: str, path: str) -> None:
    """An example agent, unchanged, against the scripted tool-then-answer policy: no failure,
    one sample of both calls per episode, reward 1."""
    engine = ToolThenAnswer(tokenizer)
    sched, _ = agent_scheduler(engine, tokenizer, EXAMPLES / folder, path, params=PARAMS)
    (group,), failed = _one_group(sched, tokenizer, 2)
    assert failed == []
    _check_tool_episodes(group, engine, 2)


def test_agents_sdk_agent_with_a_function_tool(tokenizer: Any) -> None:
    """The example's SDK agent, unchanged, on its default Responses model: its tool runs on
    the policy's call, its answer after the result earns 1, and both calls are the sample."""
    pytest.importorskip("agents")
    _run_example(tokenizer, "agents_sdk", "sdk_agent:solve")


def test_langgraph_react_agent_with_a_tool(tokenizer: Any) -> None:
    """The example's LangGraph ReAct agent, unchanged, through `ChatOpenAI`: the same tool
    call, tool result and answer as the SDK agent's, the same one sample per episode."""
    pytest.importorskip("langgraph")
    pytest.importorskip("langchain_openai")
    _run_example(tokenizer, "langgraph_agent", "react_agent:solve")


@pytest.mark.skipif(not (shutil.which("jq") and shutil.which("curl")), reason="needs jq, curl")
def test_bash_command_agent(tokenizer: Any) -> None:
    engine = ToolThenAnswer(tokenizer)
    cfg = CommandAgentConfig(
        type="command", argv=["bash", str(EXAMPLES / "command_agent/agent.sh")]
    )
    sched, _ = config_scheduler(engine, tokenizer, cfg, params=PARAMS)
    (group,), failed = _one_group(sched, tokenizer, 2)
    assert failed == []
    _check_tool_episodes(group, engine, 2)


CALLS_ONCE = """
import json, os, sys
from openai import OpenAI
item = json.loads(os.environ["ASYNCRL_ITEM"])
assert json.loads(sys.stdin.read()) == item
client = OpenAI(max_retries=0)  # OPENAI_BASE_URL / OPENAI_API_KEY: the episode's
client.chat.completions.create(model="m", messages=[{"role": "user", "content": item["prompt"]}])
"""


@pytest.mark.parametrize(
    ("tail", "reason", "detail"),
    [
        ("sys.stderr.write('boom at the end'); sys.exit(3)", "agent_error", "boom at the end"),
        ("print('the answer is 3')", "agent_error", "no JSON reward"),
        ("print(json.dumps({'r': 1}))", "agent_error", "expected a finite number"),
        (
            "import subprocess; p = subprocess.Popen(['sleep', '300']); "
            "open(os.environ['PID_FILE'], 'w').write(str(p.pid)); p.wait()",
            "agent_timeout",
            "still running",
        ),
    ],
)
def test_a_failing_command_fails_its_group_by_reason(
    tokenizer: Any, tmp_path: Path, tail: str, reason: str, detail: str
) -> None:
    """Each failure ends the group with its reason and the agent's words; a command past its
    time is killed with everything it started (its process group)."""
    script = tmp_path / "agent.py"
    script.write_text(CALLS_ONCE + tail + "\n")
    pid_file = tmp_path / "child.pid"
    cfg = CommandAgentConfig(
        type="command",
        argv=[sys.executable, str(script)],
        cwd=str(tmp_path),
        env={"PID_FILE": str(pid_file)},
        timeout_s=3.0 if reason == "agent_timeout" else 60.0,
    )
    sched, _ = config_scheduler(ToolThenAnswer(tokenizer), tokenizer, cfg, params=PARAMS)
    finished, (failure,) = _one_group(sched, tokenizer, 1)
    assert finished == []
    assert failure.reason == GroupReason(reason) and detail in failure.detail, failure
    if reason == "agent_timeout":
        assert dies(int(pid_file.read_text())), "the agent's child outlived its group"


def test_a_command_that_is_not_there_is_a_config_error(tmp_path: Path) -> None:
    (tmp_path / "agent.sh").write_text("echo 1\n")  # not executable
    for argv, cwd in ((["no-such-agent-here"], None), (["./agent.sh"], str(tmp_path))):
        with pytest.raises(ValueError, match="argv"):
            CommandAgentConfig(type="command", argv=argv, cwd=cwd)
    (tmp_path / "agent.sh").chmod(0o755)
    assert CommandAgentConfig(type="command", argv=["./agent.sh"], cwd=str(tmp_path)).argv


POSTS_ITS_REWARD = """
import httpx
url, auth = os.environ["OPENAI_BASE_URL"] + "/reward", {"Authorization": "Bearer " + client.api_key}
bad = httpx.post(url, json={"reward": "high"}, headers=auth)
assert bad.status_code == 400 and bad.json()["error"]["param"] == "reward", bad.text
assert httpx.post(url, json={"reward": 0.75}, headers=auth).status_code == 200
"""


def test_a_command_agent_may_post_its_reward(tokenizer: Any, tmp_path: Path) -> None:
    """A reward POSTed to `{base_url}/reward` (AReaL's set_reward) is the episode's when the
    agent prints none; one that is no reward is refused by a 400 naming it."""
    script = tmp_path / "agent.py"
    script.write_text(CALLS_ONCE + POSTS_ITS_REWARD)
    cfg = CommandAgentConfig(type="command", argv=[sys.executable, str(script)])
    sched, _ = config_scheduler(ToolThenAnswer(tokenizer), tokenizer, cfg, params=PARAMS)
    (group,), failed = _one_group(sched, tokenizer, 1)
    assert failed == [] and [s.reward for s in group.samples] == [0.75]
