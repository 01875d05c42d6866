"""Tool calls in model output: the Hermes/Qwen format parsed, tools loaded by import path with
schemas from their signatures, a `ToolEnvironment` episode driven directly, and through the
rollout scheduler (`task.environment.type: tools` built by `build_task`), with a real tokenizer
whose chat template renders `tools=` and `tool` messages as Qwen2.5's and Qwen3's do."""

from __future__ import annotations

import asyncio
import json
import textwrap
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from asyncrl.config import ConfigError, load_config
from asyncrl.environments.base import render_observation, render_prompt
from asyncrl.environments.config import ToolEnvironmentConfig
from asyncrl.environments.tools import (
    CallError,
    ToolCall,
    load_tools,
    parse_tool_calls,
    tool_call_counts,
    tool_environments,
    tool_prompt,
)
from asyncrl.items import PromptItem
from asyncrl.reasons import ToolCallOutcome

# The structure of Qwen2.5-Instruct's template (tools in the system turn, calls and responses
# in XML tags, consecutive tool messages in one user turn), written out here: no download.
QWEN_STYLE_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content }}"
    "{%- else %}{{- 'You are a helpful assistant.' }}{%- endif %}"
    "{{- '\\n\\n# Tools\\n\\nYou are provided with function signatures within <tools></tools>"
    " XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and"
    " arguments within <tool_call></tool_call> XML tags.<|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or message.role == 'assistant'"
    " or (message.role == 'system' and not loop.first) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.index0 == 0 or messages[loop.index0 - 1].role != 'tool' %}"
    "{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}"
    "{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Qwen3's differences that matter here: no default system turn, and an empty think block in a
# final assistant turn only (so the text before a tool message depends on what follows it).
QWEN3_STYLE_TEMPLATE = (
    QWEN_STYLE_TEMPLATE.replace("{{- 'You are a helpful assistant.' }}", "")
    .replace(
        "{%- else %}{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}", ""
    )
    .replace(
        "{%- if message.role == 'user' or message.role == 'assistant'",
        "{%- if message.role == 'assistant' %}{{- '<|im_start|>assistant\\n' }}"
        "{%- if loop.last %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
        "{{- message.content + '<|im_end|>\\n' }}"
        "{%- elif message.role == 'user'",
    )
)

TOOLS_MODULE = '''
import asyncio
import sys
import threading
import time
from typing import Literal

RELEASE = threading.Event()


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first addend.
        b: The second addend.
    """
    return a + b


async def convert(amount: float, unit: Literal["km", "mi"] = "km") -> dict:
    """Convert a distance.

    Args:
        amount: The distance.
        unit: The unit to convert to.
    """
    await asyncio.sleep(0)
    return {"amount": amount * (1.609 if unit == "km" else 0.621), "unit": unit}


async def hang() -> str:
    """Never answers."""
    await asyncio.sleep(3600)
    return "late"


def block(seconds: float) -> str:
    """Blocks its thread.

    Args:
        seconds: How long.
    """
    time.sleep(seconds)
    return "late"


def fail(x: int) -> int:
    """Raises.

    Args:
        x: Anything.
    """
    raise RuntimeError(f"no luck with {x}")


def shout(text: str) -> str:
    """Repeats the text many times.

    Args:
        text: What to repeat.
    """
    return text * 100


def stall() -> str:
    """Holds its thread until the test releases it."""
    RELEASE.wait()
    return "late"


def leave(code: int) -> str:
    """Ends its process's way.

    Args:
        code: The exit status.
    """
    sys.exit(code)


def unwritable(kind: str) -> object:
    """Returns what JSON cannot write.

    Args:
        kind: Which.
    """
    if kind == "circular":
        loop = []
        loop.append(loop)
        return loop
    return {(1, 2): "a tuple key"}


def undocumented(x):
    return x


def make():
    return {"train": [{"prompt": "What is 12+34?", "answer": "46"}]}
'''

ALL_TOOLS = ["add", "convert", "hang", "block", "fail", "shout", "stall", "leave", "unwritable"]


@pytest.fixture(scope="module")
def tool_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tool module outside the repo, imported by path like a user's."""
    root = tmp_path_factory.mktemp("usertools")
    (root / "usertools.py").write_text(textwrap.dedent(TOOLS_MODULE))
    return root


def _tokenizer(template: str) -> PreTrainedTokenizerFast:
    """Byte-level, one token per byte, with Qwen's turn markers as special tokens."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    vocab = {t: i for i, t in enumerate([*specials, *sorted(alphabet)])}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(specials)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    fast.chat_template = template
    return fast


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    return _tokenizer(QWEN_STYLE_TEMPLATE)


def _cfg(tool_dir: Path, **overrides: Any) -> ToolEnvironmentConfig:
    fields: dict[str, Any] = {
        "python_path": [str(tool_dir)],
        "tools": [f"usertools:{name}" for name in ALL_TOOLS],
        "timeout_s": 0.3,
    }
    return ToolEnvironmentConfig(**{**fields, **overrides})


def _call(name: str, **arguments: Any) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


ITEM = PromptItem("q0", "What is 12+34?", [], "46")


def test_parses_several_calls_with_text_around() -> None:
    text = f"Let me see.\n{_call('add', a=1, b=2)}\nand\n{_call('convert', amount=3.5)} done"
    assert parse_tool_calls(text) == [
        ToolCall("add", {"a": 1, "b": 2}),
        ToolCall("convert", {"amount": 3.5}),
    ]
    assert parse_tool_calls("The answer is 46.") == []
    # Arguments left out mean none; arguments written as a JSON string are read.
    assert parse_tool_calls('<tool_call>{"name": "hang"}</tool_call>') == [ToolCall("hang", {})]
    stringified = '<tool_call>{"name": "add", "arguments": "{\\"a\\": 1}"}</tool_call>'
    assert parse_tool_calls(stringified) == [ToolCall("add", {"a": 1})]


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        (
            '<tool_call>{"name": "add", "arguments": {"a": 1</tool_call>',
            ToolCallOutcome.MALFORMED_JSON,
        ),
        ("<tool_call>add(1, 2)</tool_call>", ToolCallOutcome.MALFORMED_JSON),
        ('<tool_call>["add", 1]</tool_call>', ToolCallOutcome.BAD_CALL),
        ('<tool_call>{"arguments": {}}</tool_call>', ToolCallOutcome.BAD_CALL),
        ('<tool_call>{"name": 7}</tool_call>', ToolCallOutcome.BAD_CALL),
        (
            '<tool_call>{"name": "add", "arguments": [1, 2]}</tool_call>',
            ToolCallOutcome.BAD_ARGUMENTS,
        ),
        (
            '<tool_call>{"name": "add", "arguments": "a=1"}</tool_call>',
            ToolCallOutcome.BAD_ARGUMENTS,
        ),
        ('<tool_call>{"name": "add", "arguments": {"a": 1', ToolCallOutcome.UNCLOSED_CALL),
    ],
)
def test_malformed_calls_become_errors_by_reason(text: str, reason: str) -> None:
    (call,) = parse_tool_calls(text)
    assert isinstance(call, CallError)
    assert call.reason == reason
    assert call.message.startswith("error: ")


def test_a_bad_call_does_not_hide_the_good_ones() -> None:
    calls = parse_tool_calls(f"{_call('add', a=1, b=2)}<tool_call>{{oops</tool_call>")
    assert calls[0] == ToolCall("add", {"a": 1, "b": 2})
    assert isinstance(calls[1], CallError) and calls[1].reason == ToolCallOutcome.MALFORMED_JSON


def test_schemas_come_from_signatures_and_docstrings(tool_dir: Path) -> None:
    tools = load_tools(["usertools:add", "usertools:convert"], [str(tool_dir)])
    add = tools["add"].schema
    assert add["type"] == "function"
    assert add["function"]["description"] == "Add two integers."
    params = add["function"]["parameters"]
    assert params["properties"]["a"] == {"type": "integer", "description": "The first addend."}
    assert params["required"] == ["a", "b"]
    convert = tools["convert"].schema["function"]["parameters"]
    assert convert["required"] == ["amount"]  # a default makes it optional
    assert convert["properties"]["unit"]["enum"] == ["km", "mi"]


def test_a_tool_without_a_schema_is_named(tool_dir: Path) -> None:
    with pytest.raises(ValueError, match=r"environment\.tools\[1\] 'usertools:undocumented'"):
        load_tools(["usertools:add", "usertools:undocumented"], [str(tool_dir)])


def test_arguments_are_checked_against_the_schema(tool_dir: Path) -> None:
    tools = load_tools(["usertools:add", "usertools:convert"], [str(tool_dir)])
    add, convert = tools["add"], tools["convert"]
    assert add.check({"a": 1, "b": 2}) is None
    assert "missing argument(s) b" in str(add.check({"a": 1}))
    assert "unknown argument(s) c" in str(add.check({"a": 1, "b": 2, "c": 3}))
    assert 'a="1"' in str(add.check({"a": "1", "b": 2}))
    assert add.check({"a": True, "b": 2}) is not None  # JSON true is no integer
    assert convert.check({"amount": 2}) is None  # an integer is a number
    assert convert.check({"amount": 2.0, "unit": "ft"}) is not None


def test_config_names_the_key_of_a_bad_tool(tool_dir: Path, tmp_path: Path) -> None:
    def load(tools: list[str]) -> None:
        path = tmp_path / "run.yaml"
        env = {"type": "tools", "python_path": [str(tool_dir)], "tools": tools}
        path.write_text(json.dumps({"task": {"type": "arithmetic", "environment": env}}))
        load_config(path)

    with pytest.raises(ConfigError, match=r"task\.environment\.tools.*\[1\].*nosuchmodule"):
        load(["usertools:add", "nosuchmodule:fn"])
    with pytest.raises(ConfigError, match=r"task\.environment\.tools.*a tool named 'add'"):
        load(["usertools:add", "usertools:add"])


def test_an_episode_with_tools(tool_dir: Path, tokenizer: PreTrainedTokenizerFast) -> None:
    cfg = _cfg(tool_dir, system_prompt="Use tools.")
    env = tool_environments(cfg)(ITEM, "q0/0")

    async def episode() -> list[Any]:
        first = await env.reset(ITEM)
        turn1 = await env.step(
            f"I'll add. {_call('add', a=12, b=34)}{_call('mul', a=1, b=2)}"
            f"{_call('convert', amount=10, unit='mi')}"
        )
        turn2 = await env.step(_call("add", a="12", b=34) + _call("shout", text="ab"))
        final = await env.step("46")
        await env.close()
        return [first, turn1, turn2, final]

    first, turn1, turn2, final = asyncio.run(episode())
    assert first is None  # the prompt holds the system turn and the tools already
    # The tools reach the prompt through the template's `tools=`, with the item's prompt.
    prompt = tokenizer.decode(tool_prompt(cfg, tokenizer)(ITEM))
    assert '"name": "add"' in prompt and '"name": "shout"' in prompt
    assert prompt.startswith("<|im_start|>system\nUse tools.\n\n# Tools")
    assert prompt.endswith(f"<|im_start|>user\n{ITEM.prompt}<|im_end|>\n<|im_start|>assistant\n")

    assert not turn1.done and turn1.reward is None
    assert [m["role"] for m in turn1.observation] == ["tool"] * 3  # one per call, in order
    contents = [m["content"] for m in turn1.observation]
    assert contents[0] == "46"
    assert contents[1].startswith("error: unknown tool 'mul'; available: add, convert")
    assert json.loads(contents[2]) == {"amount": pytest.approx(6.21), "unit": "mi"}
    assert turn1.info == {"tool_calls": {"ok": 2, ToolCallOutcome.UNKNOWN_TOOL: 1}}

    bad, long = (m["content"] for m in turn2.observation)
    assert bad.startswith('error: add: argument a="12" does not fit')
    assert long == "ab" * 100  # within max_result_chars
    assert turn2.info == {"tool_calls": {ToolCallOutcome.BAD_ARGUMENTS: 1, "ok": 1}}

    # No call: the final answer, left to the task's reward.
    assert final.done and final.observation is None and final.reward is None
    assert final.info == {"ended": "answer"}
    assert (env.turns, env.calls, dict(env.errors)) == (
        3,
        3,
        {ToolCallOutcome.UNKNOWN_TOOL: 1, ToolCallOutcome.BAD_ARGUMENTS: 1},
    )


@pytest.mark.parametrize(
    "template", [QWEN_STYLE_TEMPLATE, QWEN3_STYLE_TEMPLATE], ids=["qwen2.5", "qwen3"]
)
def test_observations_render_as_the_whole_conversation(tool_dir: Path, template: str) -> None:
    """Prompt + turn + observation tokens are exactly the template's rendering of the whole
    conversation, so training sees what the model will see at inference."""
    tokenizer = _tokenizer(template)
    cfg = _cfg(tool_dir)
    env = tool_environments(cfg)(ITEM, "q0/0")
    response = f"Adding. {_call('add', a=12, b=34)}{_call('add', a=1, b=1)}"
    result = asyncio.run(env.step(response))
    tools = [t.schema for t in load_tools(cfg.tools, cfg.python_path).values()]
    start = [{"role": "user", "content": ITEM.prompt}]
    prompt = tool_prompt(cfg, tokenizer)(ITEM)
    assert prompt == render_prompt(tokenizer, start, tools)
    turn_ids = tokenizer(response, add_special_tokens=False)["input_ids"]
    eos = tokenizer.eos_token_id
    observation = render_observation(tokenizer, result.observation, eos)
    conversation = [*start, {"role": "assistant", "content": response}, *result.observation]
    assert prompt + turn_ids + [eos] + observation == render_prompt(tokenizer, conversation, tools)
    text = tokenizer.decode(observation)
    assert text == (
        "\n<|im_start|>user\n<tool_response>\n46\n</tool_response>\n<tool_response>\n2\n"
        "</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    # A turn cut by the token limit never sampled its end of turn: the template's is supplied.
    cut = render_observation(tokenizer, result.observation, None)
    assert prompt + turn_ids + cut == render_prompt(tokenizer, conversation, tools)
    assert cut == [eos, *observation]


def test_hanging_tools_time_out(tool_dir: Path) -> None:
    env = tool_environments(_cfg(tool_dir, timeout_s=0.2))(ITEM, "q0/0")
    result = asyncio.run(env.step(_call("hang") + _call("block", seconds=1.0) + _call("fail", x=3)))
    hang, block, fail = (m["content"] for m in result.observation)
    assert hang == "error: hang gave no result in 0.2s"
    assert block == "error: block gave no result in 0.2s"
    assert fail == "error: fail raised RuntimeError: no luck with 3"
    assert result.info == {
        "tool_calls": {ToolCallOutcome.TOOL_TIMEOUT: 2, ToolCallOutcome.TOOL_ERROR: 1}
    }
    assert not result.done


def test_hung_sync_calls_hold_their_own_tools_threads_only(tool_dir: Path) -> None:
    """A sync tool whose calls never return fills its own threads: its later calls are refused
    at once (`tool_busy`, not queued to time out), and every other tool answers as usual. On
    the default executor (at most 32 threads, shared) 40 hung calls left no thread to any."""
    cfg = _cfg(tool_dir, max_calls_per_turn=40)
    episodes = tool_environments(cfg)
    import usertools  # the module the tools were loaded from (their python_path on sys.path)

    usertools.RELEASE.clear()

    async def turns() -> list[Any]:
        hung = await episodes(ITEM, "q0/0").step(_call("stall") * 40)
        other = await episodes(ITEM, "q1/0").step(_call("add", a=1, b=2) + _call("stall"))
        return [hung, other]

    try:
        hung, other = asyncio.run(turns())
    finally:
        usertools.RELEASE.set()
    assert hung.info == {
        "tool_calls": {ToolCallOutcome.TOOL_TIMEOUT: 32, ToolCallOutcome.TOOL_BUSY: 8}
    }
    busy = hung.observation[-1]["content"]
    assert (
        busy
        == "error: stall is busy (all 32 of its threads are held by calls not returned); not run"
    )
    assert [m["content"] for m in other.observation] == ["3", busy]
    assert other.info == {"tool_calls": {"ok": 1, ToolCallOutcome.TOOL_BUSY: 1}}


@pytest.mark.parametrize(
    ("call", "said"),
    [
        (_call("leave", code=3), "error: leave raised SystemExit: 3"),
        (
            _call("unwritable", kind="circular"),
            "error: unwritable returned what JSON cannot write: Circular reference detected",
        ),
        (
            _call("unwritable", kind="key"),
            "error: unwritable returned what JSON cannot write: "
            "keys must be str, int, float, bool or None, not tuple",
        ),
    ],
)
def test_a_tool_that_exits_or_returns_what_json_cannot_write_answers_the_model(
    tool_dir: Path, call: str, said: str
) -> None:
    env = tool_environments(_cfg(tool_dir))(ITEM, "q0/0")
    result = asyncio.run(env.step(call + _call("add", a=1, b=2)))
    assert [m["content"] for m in result.observation] == [said, "3"]
    assert (
        result.info == {"tool_calls": {ToolCallOutcome.TOOL_ERROR: 1, "ok": 1}} and not result.done
    )


def test_turn_and_call_limits(tool_dir: Path) -> None:
    cfg = _cfg(tool_dir, max_turns=2, max_calls_per_turn=2, max_result_chars=5)
    env = tool_environments(cfg)(ITEM, "q0/0")

    async def episode() -> list[Any]:
        first = await env.step(_call("shout", text="x") + _call("add", a=1, b=2) * 2)
        last = await env.step(_call("add", a=1, b=2))
        return [first, last]

    first, last = asyncio.run(episode())
    shout, three, over = (m["content"] for m in first.observation)
    assert (shout, three) == ("xxxxx", "3")  # cut to max_result_chars
    assert over.startswith("error")
    assert first.info["tool_calls"] == {"ok": 2, ToolCallOutcome.TOO_MANY_CALLS: 1}
    # The last allowed turn ends the episode even though it calls a tool; nothing is run.
    assert last.done and last.info == {"ended": "max_turns"}
    assert env.calls == 2


def test_reported_counts_are_kept_to_known_outcomes() -> None:
    """A served environment's `info` is JSON from elsewhere: junk is left out, never raised."""
    info = {
        "tool_calls": {
            "ok": 2,
            ToolCallOutcome.TOOL_ERROR: 1,
            "made_up": 3,
            ToolCallOutcome.UNKNOWN_TOOL: "x",
            ToolCallOutcome.BAD_CALL: -1,
        }
    }
    assert tool_call_counts(info) == [("ok", 2), (ToolCallOutcome.TOOL_ERROR, 1)]
    assert tool_call_counts({"tool_calls": [1]}) == [] == tool_call_counts({})


class _Replies:
    """An engine that answers each episode's turns from a script, ending each with <|im_end|>."""

    def __init__(self, tokenizer: PreTrainedTokenizerFast, turns: list[str]) -> None:
        self.tokenizer, self.turns, self.version = tokenizer, turns, 5
        self.contexts: list[list[int]] = []

    def generate(self, prompts: list[list[int]], params: Any) -> list[Any]:
        import numpy as np

        from asyncrl.engines.base import Generation

        gens = []
        for context in prompts:
            self.contexts.append(list(context))
            done = self.tokenizer.decode(context).count("<|im_start|>assistant\n") - 1
            ids = [*self.tokenizer(self.turns[done], add_special_tokens=False)["input_ids"]]
            ids.append(self.tokenizer.eos_token_id)
            n = len(ids)
            gens.append(
                Generation(
                    np.array(ids, np.int32),
                    np.full(n, -0.1, np.float32),
                    np.full(n, self.version, np.int32),
                    "stop",
                )
            )
        return gens


@pytest.mark.parametrize(
    "template", [QWEN_STYLE_TEMPLATE, QWEN3_STYLE_TEMPLATE], ids=["qwen2.5", "qwen3"]
)
def test_the_scheduler_runs_tool_episodes_of_a_task(tool_dir: Path, template: str) -> None:
    """`task.environment.type: tools` through `build_task` and the rollout scheduler: the
    episode starts from the item's prompt with the tools; prompt + response tokens are the
    template's rendering of the whole conversation; tool results are loss-masked; the task's
    reward scores the final answer; the calls are counted by outcome."""
    import time

    from asyncrl.config import load_config
    from asyncrl.engines.config import SamplingParams
    from asyncrl.rollout.scheduler import EpisodeScheduler
    from asyncrl.tasks.build import build_task

    tokenizer = _tokenizer(template)
    env = {"type": "tools", "python_path": [str(tool_dir)], "tools": ["usertools:add"]}
    task_cfg = load_config(
        None,
        [
            "task.type=python",
            f"task.python_path=[{json.dumps(str(tool_dir))}]",
            "task.path=usertools:make",
            f"task.environment={json.dumps(env)}",
        ],
    ).task
    task = build_task(task_cfg, tokenizer)
    (item,) = task.train_items(0, 0)
    turns = [_call("add", a=12, b=34) + _call("nope"), "46"]
    engine = _Replies(tokenizer, turns)
    counted: list[tuple[str, int]] = []
    sched = EpisodeScheduler(
        engine,
        task,
        tokenizer,
        SamplingParams(max_new_tokens=64),
        on_tool_calls=lambda outcome, n: counted.append((outcome, n)),
    )
    sched.start("g", item, 2, "g")
    finished: list[Any] = []
    deadline = time.monotonic() + 20
    while sched.inflight:
        assert time.monotonic() < deadline, "episodes did not end"
        done, failed = sched.advance(0.05)
        assert not failed
        finished += done
    sched.close()

    tools = [t.schema for t in load_tools(["usertools:add"], [str(tool_dir)]).values()]
    conversation = [
        {"role": "user", "content": "What is 12+34?"},
        {"role": "assistant", "content": turns[0]},
        {"role": "tool", "content": "46"},
        {"role": "tool", "content": "error: unknown tool 'nope'; available: add"},
    ]
    # The last turn as generated after the template's generation prompt.
    whole = tokenizer.decode(render_prompt(tokenizer, conversation, tools)) + "46<|im_end|>"
    (group,) = finished
    for s in group.samples:
        text = tokenizer.decode([*item.prompt_ids, *s.response_ids.tolist()])
        assert text == whole
        # Generated turns are trained on; the tool results between them are not.
        ids, mask = s.response_ids.tolist(), s.loss_mask.tolist()
        trained = tokenizer.decode([t for t, m in zip(ids, mask, strict=True) if m])
        assert trained == f"{turns[0]}<|im_end|>{turns[1]}<|im_end|>"
        assert s.reward == 1.0 and s.meta == {"turns": 2}
    assert sorted(counted) == [
        ("ok", 1),
        ("ok", 1),
        (ToolCallOutcome.UNKNOWN_TOOL, 1),
        (ToolCallOutcome.UNKNOWN_TOOL, 1),
    ]


def test_the_example_runs_an_episode(monkeypatch: pytest.MonkeyPatch) -> None:
    """examples/tool_calls: its tools have schemas, and an async one's error reaches the model."""
    root = Path(__file__).resolve().parents[1]
    monkeypatch.chdir(root)
    cfg = load_config(root / "examples/tool_calls/config.yaml").task.environment
    assert isinstance(cfg, ToolEnvironmentConfig)
    env = tool_environments(cfg)(ITEM, "q0/0")
    result = asyncio.run(
        env.step(
            _call("lookup_rate", currency="EUR")
            + _call("lookup_rate", currency="CHF")
            + _call("multiply", a=100, b=1.08)
        )
    )
    rate, unknown, product = (m["content"] for m in result.observation)
    assert (rate, product) == ("1.08", "108.0")
    assert unknown == "error: lookup_rate raised KeyError: 'CHF'"
    assert list(load_tools(cfg.tools, cfg.python_path)) == ["add", "multiply", "lookup_rate"]


def test_a_dataset_prompt_of_chat_messages_keeps_every_message(
    tool_dir: Path, tmp_path: Path
) -> None:
    """A dataset row whose prompt is a conversation starts its tool episodes from all of it,
    its own system message kept in place of the configured one."""
    from asyncrl.tasks.build import build_task

    tokenizer = _tokenizer(QWEN_STYLE_TEMPLATE)
    messages = [
        {"role": "system", "content": "You add numbers."},
        {"role": "user", "content": "What is 1+1?"},
        {"role": "assistant", "content": "2"},
        {"role": "user", "content": "And 12+34?"},
    ]
    data = tmp_path / "train.jsonl"
    data.write_text(json.dumps({"prompt": messages, "answer": "46"}) + "\n")
    env = {
        "type": "tools",
        "python_path": [str(tool_dir)],
        "tools": ["usertools:add"],
        "system_prompt": "the configured one",
    }
    overrides = ["task.type=dataset", f"task.train_file={data}"]
    cfg = load_config(None, [*overrides, f"task.environment={json.dumps(env)}"])
    (item,) = build_task(cfg.task, tokenizer).train_items(0, 0)
    schemas = [t.schema for t in load_tools(["usertools:add"], [str(tool_dir)]).values()]
    assert item.prompt_ids == render_prompt(tokenizer, messages, schemas)
    text = tokenizer.decode(item.prompt_ids)
    assert "What is 1+1?" in text and "And 12+34?" in text and "configured" not in text
    assert item.prompt == "And 12+34?"
