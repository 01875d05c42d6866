"""The gateway tests' model, task and scheduler: a random tiny model whose tokenizer spells
tool calls and whose chat template renders tools, tool calls and tool results (Hermes-like),
and an `EpisodeScheduler` running `task.agent` agents over a real gateway."""

from __future__ import annotations

import textwrap
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from asyncrl.agents.config import AgentConfig, PythonAgentConfig
from asyncrl.agents.episode import AgentEpisodes
from asyncrl.gateway.config import GatewayConfig
from asyncrl.gateway.server import Gateway
from asyncrl.items import PromptItem
from asyncrl.rollout.groups import FailedGroup, FinishedGroup
from asyncrl.rollout.scheduler import EpisodeScheduler
from asyncrl.tasks.build import build_agent

CHARS = ' abcdefghijklmnopqrstuvwxyz0123456789+=.,:?!<>/{}"_[]\n'
TEMPLATE = (
    "{%- if tools %}system: tools{% for t in tools %} {{ t.function.name }}{% endfor %}\n"
    "{% endif %}"
    "{%- for m in messages %}{{ m.role }}: {{ m.content or '' }}"
    '{%- for c in m.tool_calls or [] %}<tool_call>{"name": "{{ c.function.name }}", '
    '"arguments": {{ c.function.arguments | tojson }}}</tool_call>{% endfor %}\n{% endfor %}'
    "{%- if add_generation_prompt %}assistant: {% endif %}"
)
CALL_TEXT = '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'


def tool_model(out: Path) -> Path:
    from transformers import AutoTokenizer

    from asyncrl.tiny_model import save_random_tiny_model

    save_random_tiny_model(out, seed=0, chars=CHARS)
    tokenizer = AutoTokenizer.from_pretrained(out)
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(out)
    return out


class ExactTask:
    """Items `prompt` → answer; reward 1 for the exact answer."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def item(self, prompt: str, answer: str = "3") -> PromptItem:
        return PromptItem(prompt, prompt, self.tokenizer(prompt)["input_ids"], answer)

    def train_items(self, seed: int, epoch: int) -> Sequence[PromptItem]:
        return []

    def eval_items(self) -> Sequence[PromptItem]:
        return []

    def score(self, item: PromptItem, response_text: str) -> float:
        return float(response_text.strip() == item.answer)


def agent_run_settings(steps: int, groups: int, n: int) -> dict[str, Any]:
    """`write_role_config` settings of a small agent run on an arithmetic task (add
    `task.agent.*`): `steps` steps of `groups` groups of `n` episodes, short answers."""
    return {
        "model.build_tiny": False,
        "task.type": "arithmetic",
        "task.digits": 1,
        "task.eval_size": 10,
        "rollout.n": n,
        "rollout.prompts_per_batch": 2,
        "rollout.sampling.max_new_tokens": 4,
        "trainer.groups_per_step": groups,
        "trainer.max_steps": steps,
        "trainer.eval_every": 0,
        "trainer.wait_timeout_s": 120,
        "algo.max_staleness": 2,
        # An untrained model earns reward 0 everywhere: keep its groups so that steps train.
        "algo.filter_zero_variance": False,
        "weights.type": "broadcast",
    }


def agent_module(folder: Path, name: str, source: str) -> None:
    (folder / f"{name}.py").write_text(textwrap.dedent(source))


def agent_scheduler(
    engine: Any,
    tokenizer: Any,
    folder: Path,
    path: str,
    *,
    params: Any,
    max_context: int | None = None,
    batch_wait_s: float = 0.0,
    **agent: Any,
) -> tuple[EpisodeScheduler[str], Gateway]:
    cfg = PythonAgentConfig(python_path=[str(folder)], path=path, **agent)
    return config_scheduler(
        engine, tokenizer, cfg, params=params, max_context=max_context, batch_wait_s=batch_wait_s
    )


def config_scheduler(
    engine: Any, tokenizer: Any, cfg: AgentConfig, params: Any, **scheduler: Any
) -> tuple[EpisodeScheduler[str], Gateway]:
    """An `EpisodeScheduler` (`scheduler`: its keyword arguments) running the agent of `cfg`
    over a real gateway."""
    gateway = Gateway(GatewayConfig(), tokenizer, len(tokenizer))
    agents = AgentEpisodes(build_agent(cfg), cfg, gateway)
    task = ExactTask(tokenizer)
    sched: EpisodeScheduler[str] = EpisodeScheduler(
        engine, task, tokenizer, params, kind=agents, **scheduler
    )
    return sched, gateway


def dies(pid: int) -> bool:
    """Whether `pid` is gone or a zombie within a few seconds (SIGKILL is not instant)."""
    for _ in range(100):
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            return True
        if state == "Z":
            return True
        time.sleep(0.05)
    return False


def run_groups(sched: Any, groups: int) -> tuple[list[FinishedGroup[str]], list[FailedGroup[str]]]:
    finished: list[FinishedGroup[str]] = []
    failed: list[FailedGroup[str]] = []
    for _ in range(2000):
        done, bad = sched.advance(0.05)
        finished += done
        failed += bad
        if len(finished) + len(failed) == groups:
            return finished, failed
    raise AssertionError("groups did not end")
