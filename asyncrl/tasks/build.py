"""The task an episode runs, with its environment or its agent, built from config: the one place
that names task, environment and agent classes (the `match` on each config's `type`). Roles and
tools call `build_task` (and `build_agent`); the seams it builds from (`tasks.base`,
`environments.base`, `agents.base`) name no member."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, assert_never

from asyncrl.agents.command import CommandAgent
from asyncrl.agents.config import (
    AgentConfig,
    CommandAgentConfig,
    PythonAgentConfig,
    RemoteAgentConfig,
    VerifiersConfig,
)
from asyncrl.agents.python import PythonAgent
from asyncrl.agents.remote import RemoteAgent
from asyncrl.agents.verifiers import VerifiersAgent
from asyncrl.environments.client import RemotePool
from asyncrl.environments.config import (
    EnvironmentConfig,
    PythonEnvironmentConfig,
    RemoteEnvironmentConfig,
    ToolEnvironmentConfig,
)
from asyncrl.environments.local import TimedEnvironment, check_class
from asyncrl.environments.tools import tool_environments, tool_prompt
from asyncrl.items import PromptItem
from asyncrl.plugins import factory_kwargs, load_object
from asyncrl.tasks.agentic import AgenticTask
from asyncrl.tasks.base import (
    ArithmeticTask,
    DatasetError,
    DatasetTask,
    Records,
    RecordsTask,
    Task,
    WithEnvironment,
)
from asyncrl.tasks.config import (
    AgenticTaskConfig,
    ArithmeticTaskConfig,
    DatasetTaskConfig,
    PythonTaskConfig,
    ReasoningGymTaskConfig,
    TaskConfig,
    VerifiersTaskConfig,
)
from asyncrl.tasks.gym import ReasoningGymTask
from asyncrl.tasks.verifiers import VerifiersTask

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from asyncrl.agents.base import Agent
    from asyncrl.environments.base import EnvironmentFactory


def build_task(cfg: TaskConfig, tokenizer: PreTrainedTokenizerBase) -> Task:
    """The task of `cfg`; its episodes talk to `cfg.environment` when one is set."""
    task = _build_task(cfg, tokenizer)
    if cfg.environment is None:
        return task
    env = cfg.environment
    return WithEnvironment(task, build_environments(env), build_prompt(env, tokenizer))


def _build_task(cfg: TaskConfig, tokenizer: PreTrainedTokenizerBase) -> Task:
    match cfg:
        case ArithmeticTaskConfig():
            return ArithmeticTask(cfg, tokenizer)
        case DatasetTaskConfig():
            return DatasetTask(cfg, tokenizer)
        case AgenticTaskConfig():
            return AgenticTask(cfg, tokenizer)
        case PythonTaskConfig():
            return _python_task(cfg, tokenizer)
        case ReasoningGymTaskConfig():
            return ReasoningGymTask(cfg, tokenizer)
        case VerifiersTaskConfig():
            return VerifiersTask(cfg, tokenizer)
        case _:
            assert_never(cfg)


def _python_task(cfg: PythonTaskConfig, tokenizer: PreTrainedTokenizerBase) -> Task:
    """The user's factory called once; its `Task` as it is, or its records wrapped."""
    factory = load_object(cfg.path, cfg.python_path)
    made = factory(**factory_kwargs(factory, cfg.kwargs, tokenizer))
    if all(callable(getattr(made, m, None)) for m in ("train_items", "eval_items", "score")):
        return made
    if isinstance(made, Mapping) and "train" in made and set(made) <= {"train", "eval"}:
        evals = made.get("eval")
        return RecordsTask(
            cfg,
            tokenizer,
            (f"{cfg.path} train", _numbered(made["train"])),
            None if evals is None else (f"{cfg.path} eval", _numbered(evals)),
        )
    raise DatasetError(
        f"task.path: {cfg.path} returned {type(made).__name__}; expected a Task "
        "(train_items, eval_items, score) or {'train': records, 'eval': records}"
    )


def _numbered(records: Iterable[object]) -> Records:
    for number, record in enumerate(records):
        yield number, f"record {number}", record


def build_environments(cfg: EnvironmentConfig) -> EnvironmentFactory:
    """The factory of one episode's environment under `cfg`."""
    match cfg:
        case PythonEnvironmentConfig():
            cls = check_class(cfg.path, cfg.python_path, cfg.kwargs)
            return lambda item, episode_id: TimedEnvironment(cls(**cfg.kwargs), cfg.timeout_s)
        case RemoteEnvironmentConfig():
            pool = RemotePool(cfg)
            return lambda item, episode_id: pool.environment()
        case ToolEnvironmentConfig():
            return tool_environments(cfg)
        case _:
            assert_never(cfg)


def build_prompt(
    cfg: EnvironmentConfig, tokenizer: PreTrainedTokenizerBase
) -> Callable[[PromptItem], list[int]] | None:
    """The token ids an episode of an item starts from under `cfg`; None: the task's own
    `prompt_ids` (the environment's `reset` adds to them)."""
    if not isinstance(cfg, ToolEnvironmentConfig):
        return None
    return tool_prompt(cfg, tokenizer)


def build_agent(cfg: AgentConfig | VerifiersConfig) -> Agent:
    """The agent of `cfg` (`tasks.config.agent_of` finds a task's)."""
    match cfg:
        case PythonAgentConfig():
            return PythonAgent(cfg)
        case CommandAgentConfig():
            return CommandAgent(cfg)
        case RemoteAgentConfig():
            return RemoteAgent(cfg)
        case VerifiersConfig():
            return VerifiersAgent(cfg)
        case _:
            assert_never(cfg)
