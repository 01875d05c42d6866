"""Config sections of the generation side: engine, sampling, tasks and rewards.

Backends are chosen by a `type` field (pydantic discriminated unions), so an unknown backend is
reported with the allowed values and adding one is one class plus one union member. Nothing here
imports torch: the CLI validates configs without it.
"""

from typing import Annotated, Literal

from pydantic import Field, model_validator

from asyncrl.configbase import Section


class TorchEngineConfig(Section):
    """The builtin engine: a Hugging Face causal LM driven by a KV-cached sampling loop."""

    type: Literal["torch"] = "torch"
    """Engine backend."""

    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Dtype the weights are loaded in; logits are processed in float32 either way."""

    max_batch_size: int = Field(default=256, ge=1)
    """Most sequences decoded together; larger requests are split into micro-batches."""

    seed: int = 0
    """Seed of the engine's sampling generator (one stream over the engine's lifetime)."""

    prefix_cache_tokens: int = Field(default=0, ge=0)
    """Tokens of KV kept after each sequence ends, so that a request extending it (an episode's
    next turn) prefills only the tokens added since; least recently stored evicted first. 0: no
    cache (single-turn tasks never hit it)."""

    prefix_cache_stale: bool = False
    """Reuse cached KV computed by weights older than the loaded ones, as running sequences do
    across a weight swap. False: a swap drops every entry the new weights did not compute, so a
    token's version names the weights behind its whole context (SGLang's `retract` flushes its
    cache the same way)."""


class SglangEngineConfig(Section):
    """SGLang servers driven over HTTP (`asyncrl.rollout.sglang_engine`); nothing of SGLang is
    imported here, so the servers may run from their own environment (SGLang pins its own torch).
    Weights reach them through the trainer's SGLang publisher (`asyncrl.weights.sglang`)."""

    type: Literal["sglang"] = "sglang"
    """Engine backend."""

    urls: list[str] | None = None
    """Base URLs of running servers to attach to, e.g. ["http://10.0.0.5:30000"]. Each must
    serve this run's model and report weight version 0 at first (`--weight-version 0`; SGLang's
    default name "default" is read as 0 too). None: `launch` must be true."""

    launch: bool = False
    """Start the servers here with `{python} -m sglang.launch_server` and stop them on exit."""

    servers: int = Field(default=1, ge=1)
    """Servers to launch (with `launch`); server i listens on `port + i`."""

    python: str = "python"
    """Interpreter that has SGLang installed (with `launch`); e.g. a separate venv's python."""

    host: str = "127.0.0.1"
    """Bind address of launched servers; the engine and the trainer reach them there."""

    port: int = Field(default=30000, ge=1, le=65535)
    """Port of the first launched server."""

    device: Literal["cuda", "npu", "cpu"] = "cuda"
    """Device kind of launched servers: their `--device` flag and visible-devices variable."""

    devices_per_server: int = Field(default=1, ge=1)
    """Accelerators each launched server sees (server i gets devices i·k … i·k+k−1); set the
    matching `--tp-size` in `server_args`."""

    server_args: dict[str, str | int | float | bool] = Field(default_factory=dict)
    """Extra `launch_server` flags, e.g. {"mem_fraction_static": 0.7}; `name: true` passes a
    bare flag `--name`, false omits it."""

    startup_timeout_s: float = Field(default=900.0, gt=0)
    """Longest wait for a launched server's /health (model loading, graph capture)."""

    timeout_s: float = Field(default=600.0, gt=0)
    """Longest wait for one /generate reply; a server past it counts as dead."""

    retries: int = Field(default=3, ge=0)
    """Further attempts of a failed request (on another server when there is one)."""

    backoff_s: float = Field(default=0.5, ge=0)
    """Wait before the first retry; doubled at each further one (with jitter)."""

    backoff_max_s: float = Field(default=10.0, ge=0)
    """Cap of the retry wait."""

    health_interval_s: float = Field(default=5.0, gt=0)
    """A dead server's /health is asked at most this often; it rejoins once it answers 200."""

    health_timeout_s: float = Field(default=5.0, gt=0)
    """Longest wait for one /health answer."""

    chunk_size: int = Field(default=8, ge=1)
    """Prompts per /generate request; chunks are spread over the live servers."""

    max_concurrency: int = Field(default=64, ge=1)
    """Requests in flight at once over all servers (the client's thread pool)."""

    pause_mode: Literal["retract", "in_place", "none"] = "retract"
    """How the trainer's publisher quiets a server for a weight update. `retract`: running
    requests go back to the queue and are recomputed under the new weights (the KV cache is
    flushed: no key computed by old weights survives). `in_place`: they keep their KV cache and
    go on after the update (cache not flushed). `none`: no pause; SGLang then applies the update
    once the running requests have finished. Needs SGLang ≥ 0.5.6; older servers are not
    paused."""

    @model_validator(mode="after")
    def _check(self) -> "SglangEngineConfig":
        if self.launch and self.urls:
            raise ValueError(
                "rollout.engine: set either urls (attach) or launch: true (start servers), not both"
            )
        if not self.launch and not self.urls:
            raise ValueError(
                "rollout.engine.urls is empty: give the servers' URLs or set "
                "rollout.engine.launch: true"
            )
        return self


EngineConfig = Annotated[TorchEngineConfig | SglangEngineConfig, Field(discriminator="type")]


class SamplingParams(Section):
    """How tokens are drawn. Lives here, torch-free, so that configs can embed it directly.

    Processing order, shared by the engine and the trainer (`sampling.sampling_logprobs`):
    temperature, then top-k, then top-p, then renormalisation.
    """

    temperature: float = Field(default=1.0, ge=0.0)
    """Logits are divided by it; 0 means greedy (the argmax gets log-probability 0)."""

    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    """Nucleus: keep the most likely tokens until their mass reaches top_p; 1 disables."""

    top_k: int = Field(default=0, ge=0)
    """Keep the k most likely tokens (ties at the k-th value are kept too); 0 disables."""

    max_new_tokens: int = Field(default=64, ge=1)
    """Longest response; a response cut here finishes with reason "length"."""

    stop_token_ids: tuple[int, ...] | None = None
    """Tokens that end a response (kept as its last token); None: the model's EOS ids."""


class ExactRewardConfig(Section):
    """Reward 1.0 when the response, stripped of surrounding whitespace, equals the answer."""

    type: Literal["exact"] = "exact"
    """Reward backend."""


class MathRewardConfig(Section):
    """Reward 1.0 when the final answer (`#### x` or `\\boxed{x}`) matches after normalisation."""

    type: Literal["math"] = "math"
    """Reward backend."""


RewardConfig = Annotated[ExactRewardConfig | MathRewardConfig, Field(discriminator="type")]


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


class DatasetTaskConfig(Section):
    """Prompts and reference answers read from JSONL or Parquet files."""

    type: Literal["dataset"] = "dataset"
    """Task backend."""

    train_file: str
    """Train split: a `.jsonl` or `.parquet` file."""

    eval_file: str | None = None
    """Held-out split, same formats; None: no eval split."""

    prompt_field: str = "prompt"
    """Column holding the prompt text."""

    answer_field: str = "answer"
    """Column holding the reference answer text."""

    chat_template: bool | None = None
    """Wrap each prompt as a user turn of the tokenizer's chat template; None: when it has one."""

    skip_bad_rows: bool = False
    """Skip and count rows with a missing, non-string or empty field instead of failing."""

    reward: RewardConfig = Field(default_factory=MathRewardConfig)
    """How a response is scored against the answer."""


class AgenticTaskConfig(Section):
    """Multi-turn episodes: `turns` questions `a+b=`, one per turn. Each answer goes to a tool
    (the environment) that takes a log-normally distributed time before it returns the next
    question, so episode times spread over tens of times; see `asyncrl.rollout.agentic`."""

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

    reward: RewardConfig = Field(default_factory=ExactRewardConfig)
    """How each answer is scored against its sum; the episode's reward is the mean over turns."""


TaskConfig = Annotated[
    ArithmeticTaskConfig | DatasetTaskConfig | AgenticTaskConfig, Field(discriminator="type")
]
