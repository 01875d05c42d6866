"""Config sections of the generation side: engine, sampling, tasks and rewards.

Backends are chosen by a `type` field (pydantic discriminated unions), so an unknown backend is
reported with the allowed values and adding one is one class plus one union member. Nothing here
imports torch: the CLI validates configs without it.
"""

from typing import Annotated, Literal

from pydantic import Field

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


# The SGLang engine joins this union as a second member (`type: "sglang"`); with one member the
# union still validates `type` and names the allowed values.
EngineConfig = Annotated[TorchEngineConfig, Field(discriminator="type")]


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


TaskConfig = Annotated[ArithmeticTaskConfig | DatasetTaskConfig, Field(discriminator="type")]
