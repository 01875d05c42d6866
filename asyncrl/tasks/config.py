"""Config of the tasks and their rewards. Nothing here imports torch: the CLI validates configs
without it. Backends are chosen by `type` (pydantic discriminated unions).
"""

from typing import Annotated, Any, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from asyncrl.agents.config import AgentConfig, VerifiersConfig
from asyncrl.configbase import PluginConfig, Section
from asyncrl.environments.config import EnvironmentConfig
from asyncrl.plugins import call_shape, check_signature, factory_kwargs, load_object


class ExactRewardConfig(Section):
    """Reward 1.0 when the response, stripped of surrounding whitespace, equals the answer."""

    type: Literal["exact"] = "exact"
    """Reward backend."""


class MathRewardConfig(Section):
    """Reward 1.0 when the final answer (after `####`, else math-verify's pick: the last
    `\\boxed{x}`, else the last expression) equals the reference mathematically (math-verify)."""

    type: Literal["math"] = "math"
    """Reward backend."""


class PythonRewardConfig(PluginConfig):
    """Your own reward: `fn(response: str, answer: Any, **kwargs) -> float` (or an `async def`
    returning one). `response` is the decoded response (special tokens removed), `answer` the
    item's reference answer as the task gives it (a dataset's value as stored: str, number,
    list or map). It runs in a child process of its own. A call that raises, outlives
    `timeout_s` or returns a non-number or a non-finite number fails the episode's group, which
    is dead-lettered with reason `reward_error`, `reward_timeout` or `reward_invalid`."""

    type: Literal["python"] = "python"
    """Reward backend."""

    timeout_s: float = Field(default=10.0, gt=0)
    """Seconds one call may take; past that its process (its whole process group, helpers it
    started included) is killed and restarted."""

    @field_validator("kwargs")
    @classmethod
    def _sendable(cls, kwargs: dict[str, Any]) -> dict[str, Any]:
        from asyncrl.tasks.isolated import unsendable

        problem = unsendable(kwargs)
        if problem is not None:
            raise ValueError(problem)
        return kwargs

    @field_validator("path")
    @classmethod
    def _resolve(cls, path: str, info: ValidationInfo) -> str:
        kwargs = info.data.get("kwargs", {})
        fn = load_object(path, info.data.get("python_path", []))
        check_signature(fn, call_shape("fn", ["response", "answer"], kwargs), "", None, **kwargs)
        return path


RewardConfig = Annotated[
    ExactRewardConfig | MathRewardConfig | PythonRewardConfig, Field(discriminator="type")
]


def operand_pairs(digits: int) -> int:
    """Ordered operand pairs of `digits` digits (one digit: 0..9; more: no leading zero)."""
    return (10 if digits == 1 else 9 * 10 ** (digits - 1)) ** 2


class ArithmeticTaskConfig(Section):
    """Synthetic `a+b=` prompts whose operands have exactly `digits` digits."""

    type: Literal["arithmetic"] = "arithmetic"
    """Task backend."""

    digits: int = Field(default=2, ge=1, le=9)
    """Digits of each operand (2: 10..99)."""

    eval_size: int = Field(default=500, ge=1)
    """Held-out pairs, never in the train split."""

    train_size: int = Field(default=100_000, ge=1)
    """Most train pairs; fewer when the pair space is smaller (2 digits: 8,100 pairs in all)."""

    seed: int = 0
    """Seed of the split; keep it fixed so that eval scores stay comparable across runs."""

    reward: RewardConfig = Field(default_factory=ExactRewardConfig)
    """How a response is scored against the sum."""

    environment: EnvironmentConfig | None = None
    """The environment each episode talks to between turns (`asyncrl.environments`); None:
    one turn, scored by `reward`."""

    agent: AgentConfig | None = None
    """Your agent, unchanged, run once per episode against the worker's OpenAI-compatible
    gateway (`asyncrl.gateway`), its calls recorded token for token; excludes `environment`.
    See docs/agents.md."""

    @model_validator(mode="after")
    def _split(self) -> "ArithmeticTaskConfig":
        pairs = operand_pairs(self.digits)
        if self.eval_size >= pairs:
            raise ValueError(
                f"task.eval_size={self.eval_size} leaves no train pairs: "
                f"{self.digits}-digit operands make {pairs} pairs"
            )
        return self


class _RecordsConfig(Section):
    """How records (dataset rows, a factory's records) become prompts and answers."""

    type: str
    """Backend; each member narrows it to its tag (declared here so that it comes first)."""

    prompt_field: str = "prompt"
    """Field holding the prompt: a string, or chat messages (a list of `{role, content}`),
    which are rendered with the tokenizer's chat template."""

    answer_field: str = "answer"
    """Field holding the reference answer, handed to the reward as stored: a string, a number,
    a list or a map."""

    chat_template: bool | None = None
    """Wrap each string prompt as a user turn of the tokenizer's chat template; None: when it
    has one. Chat messages are always rendered with it."""

    skip_bad_rows: bool = False
    """Skip and count rows with a missing or empty field, or a prompt that is neither a string
    nor chat messages, instead of failing."""

    environment: EnvironmentConfig | None = None
    """The environment each episode talks to between turns (`asyncrl.environments`); None:
    one turn, scored by `reward`."""

    agent: AgentConfig | None = None
    """Your agent, unchanged, run once per episode against the worker's OpenAI-compatible
    gateway (`asyncrl.gateway`), its calls recorded token for token; excludes `environment`.
    See docs/agents.md."""


class DatasetTaskConfig(_RecordsConfig):
    """Prompts and reference answers read from JSONL or Parquet files, or from a Hugging Face
    dataset saved with `save_to_disk` (needs the `datasets` extra)."""

    type: Literal["dataset"] = "dataset"
    """Task backend."""

    train_file: str
    """Train split: a `.jsonl` or `.parquet` file, or the directory of a saved dataset (of a
    saved `DatasetDict`: the split's directory, e.g. `data/gsm8k/train`)."""

    eval_file: str | None = None
    """Held-out split, same formats; None: no eval split."""

    reward: RewardConfig = Field(default_factory=MathRewardConfig)
    """How a response is scored against the answer."""


class PythonTaskConfig(PluginConfig, _RecordsConfig):
    """Your own task: `factory(**kwargs)` (given `tokenizer=` too when it has a `tokenizer`
    parameter) returns either a `Task` (`asyncrl.tasks.base.Task`: `train_items`,
    `eval_items`, `score`; `reward` is then unused), or a map `{"train": records, "eval":
    records}` ("eval" optional) of iterables of records (maps), read like dataset rows and
    scored with `reward`. Called once per role at start-up."""

    type: Literal["python"] = "python"
    """Task backend."""

    reward: RewardConfig = Field(default_factory=ExactRewardConfig)
    """How a response is scored against a record's answer (records only)."""

    @field_validator("path")
    @classmethod
    def _resolve(cls, path: str, info: ValidationInfo) -> str:
        factory = load_object(path, info.data.get("python_path", []))
        kwargs = factory_kwargs(factory, info.data.get("kwargs", {}), tokenizer=None)
        check_signature(factory, call_shape("factory", [], kwargs), **kwargs)
        return path


class AgenticTaskConfig(Section):
    """Multi-turn episodes: `turns` questions `a+b=`, one per turn. Each answer goes to a tool
    (the environment) that takes a log-normally distributed time before it returns the next
    question, so episode times spread over tens of times; see `asyncrl.tasks.agentic`."""

    type: Literal["agentic"] = "agentic"
    """Task backend."""

    digits: int = Field(default=2, ge=1, le=9)
    """Digits of each operand (2: 10..99)."""

    turns: int = Field(default=3, ge=1, le=16)
    """Questions per episode. The context grows by a question and an answer every turn and
    must fit the model's positions (the tiny model has 128)."""

    eval_size: int = Field(default=500, ge=1)
    """Held-out episodes, whose questions are never in the train split."""

    train_size: int = Field(default=100_000, ge=1)
    """Most train episodes; fewer when the pair space is smaller (2 digits, 3 turns: 2,200)."""

    seed: int = 0
    """Seed of the split; keep it fixed so that eval scores stay comparable across runs."""

    tool_latency_median_s: float = Field(default=0.2, ge=0.0)
    """Median seconds of one tool call (the wait before each observation and the verdict)."""

    tool_latency_sigma: float = Field(default=1.0, ge=0.0)
    """σ of the log of a tool call's seconds; 0: every call takes the median. At 1 the
    slowest of a thousand calls takes about 20× the median."""

    latency_seed: int = 0
    """Seed of the latency draws; an episode draws from (latency_seed, its episode id)."""

    hard_tool_factor: float = Field(default=1.0, ge=1.0)
    """Tool calls of hard episodes take this many times as long (1: no difference). An episode
    is hard when its first sum has more digits than its operands (a carry out of the top digit,
    one more answer token): long because hard, the class a staleness policy that drops slow
    groups starves (`tools/bench_long.py`)."""

    reward: RewardConfig = Field(default_factory=ExactRewardConfig)
    """How each answer is scored against its sum; the episode's reward is the mean over turns."""

    environment: EnvironmentConfig | None = None
    """Where the tool runs instead of in the worker: e.g. `{type: remote, urls: [...]}` with
    `asyncrl env-server --env asyncrl.tasks.agentic:ArithmeticToolEnvironment`; None: the
    simulated tool in the worker's event loop."""

    @model_validator(mode="after")
    def _split(self) -> "AgenticTaskConfig":
        pairs = operand_pairs(self.digits)
        if self.eval_size * self.turns >= pairs:
            raise ValueError(
                f"task.eval_size={self.eval_size} × task.turns={self.turns} questions leave no "
                f"train questions: {self.digits}-digit operands make {pairs} pairs"
            )
        return self


class ReasoningGymTaskConfig(Section):
    """Any reasoning-gym dataset by name (`pip install 'asyncrl[gym]'`), scored by the dataset's
    own `score_answer`; see `asyncrl.tasks.gym`."""

    type: Literal["reasoning_gym"] = "reasoning_gym"
    """Task backend."""

    name: str
    """Dataset name as `reasoning_gym.create_dataset` knows it (`basic_arithmetic`, `chain_sum`,
    ...); checked when a role starts."""

    config: dict[str, Any] = Field(default_factory=dict)
    """The dataset's own config keys (e.g. `min_digits`), passed to `create_dataset`; checked
    against the dataset's config class when a role starts. Its seed and size are `seed`/`size`
    (train) and `eval_seed`/`eval_size` (held out)."""

    @field_validator("config")
    @classmethod
    def _no_split_keys(cls, config: dict[str, Any]) -> dict[str, Any]:
        if clash := sorted({"seed", "size"} & config.keys()):
            raise ValueError(f"{', '.join(clash)}: set task.seed / task.size instead")
        return config

    seed: int = 0
    """Seed of the train split's generator."""

    eval_seed: int | None = None
    """Seed of the held-out split's generator; None: `seed + size`, so that generators that
    seed item i with `seed + i` do not replay train items."""

    size: int = Field(default=10_000, ge=1)
    """Train items generated (before held-out questions are removed from them)."""

    eval_size: int = Field(default=500, ge=1)
    """Held-out items."""

    chat_template: bool | None = None
    """Wrap each prompt as a user turn of the tokenizer's chat template; None: when it has one."""

    environment: EnvironmentConfig | None = None
    """The environment each episode talks to between turns (`asyncrl.environments`); None:
    one turn, scored by the dataset's `score_answer`."""

    agent: AgentConfig | None = None
    """Your agent, unchanged, run once per episode against the worker's OpenAI-compatible
    gateway (`asyncrl.gateway`), its calls recorded token for token; excludes `environment`.
    See docs/agents.md."""


class VerifiersTaskConfig(VerifiersConfig):
    """A verifiers environment (prime-rl's library, `verifiers>=0.4,<0.5`) trained as it is: its
    taskset's tasks are the items, each episode runs through verifiers' own machinery
    (`Env.run_slot`, its harness and interception server) in a runner process of the
    verifiers venv, every model call relayed to the episode's gateway session, which records
    what the engine sampled; the reward is the rubric's (`Trace.reward`). Held-out evaluation
    runs the eval split the same way. See docs/tutorials/verifiers.md. The limits (`timeout_s`,
    `max_calls`, `max_tokens`) are an agent's, per episode."""

    @property
    def environment(self) -> None:
        """An agent runs its own loop: no asyncrl environment."""
        return None


TaskConfig = Annotated[
    ArithmeticTaskConfig
    | DatasetTaskConfig
    | AgenticTaskConfig
    | PythonTaskConfig
    | ReasoningGymTaskConfig
    | VerifiersTaskConfig,
    Field(discriminator="type"),
]


def agent_of(task: TaskConfig) -> AgentConfig | VerifiersConfig | None:
    """The agent a task's episodes run, by the task's type: its `agent` key, or the task itself
    (a verifiers environment is its own agent); None: its episodes are its own."""
    match task:
        case VerifiersTaskConfig():
            return task
        case AgenticTaskConfig():
            return None
        case _:
            return task.agent
