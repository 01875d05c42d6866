"""The wire records of the `prompts` and `trajectories` streams (`PromptGroup`,
`TrajectoryGroup` and its `Sample`s), the bounds a reader enforces (`Limits`) and the error with
its stable reason codes that a message failing them raises (`ValidationError`)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Literal

import numpy as np

# Trajectory groups: schema 2 (the bulk codec: each array over all samples in one binary field)
# is written, schemas 1 (one map per sample) and 2 are read, so entries that workers of before
# the change wrote still train. Prompt groups did not change: schema 1 both ways.
SCHEMA_VERSION = 2
SCHEMA_VERSIONS: frozenset[int] = frozenset({1, 2})
PROMPT_SCHEMA = 1

Finish = Literal["stop", "length", "abort"]
# In this order they are the codes 0, 1, 2 of schema 2's `finish` field.
FINISH_CODES: tuple[Finish, ...] = ("stop", "length", "abort")
FINISH_REASONS: frozenset[str] = frozenset(FINISH_CODES)

# Reasons are short and stable: they become the `reason` label of the dropped/dead-letter metrics
# and the reason field of `dlq` entries.
Reason = Literal[
    "schema",
    "malformed",
    "too_large",
    "length_mismatch",
    "logprob_not_finite",
    "logprob_positive",
    "versions_decreasing",
    "version_ahead",
    "version_negative",
    "reward_not_finite",
    "finish",
    "loss_mask",
    "token_out_of_range",
    "routing_shape",
    "routing_out_of_range",
]

# Meta maps must be flat: with scalar values only, a message nests at most four levels deep.
MetaValue = None | bool | int | float | str


class ValidationError(ValueError):
    """A message that must not be used; `reason` is one of `Reason`, the message is for humans."""

    def __init__(self, reason: Reason, message: str) -> None:
        # Both go into args so the exception survives pickling across process pools.
        super().__init__(reason, message)
        self.reason: Reason = reason
        self.message = message

    def __str__(self) -> str:
        return f"{self.reason}: {self.message}"


@dataclass(frozen=True, slots=True)
class Limits:
    """Bounds a reader enforces before trusting a message."""

    # Encoded size; checked before unpacking, so an oversize entry costs nothing to reject.
    max_message_bytes: int = 64 * 2**20
    # Samples in one trajectory group, and `n` of a prompt group.
    max_samples: int = 1024
    # Response tokens of one sample.
    max_response_tokens: int = 131072
    # Prompt tokens of one group.
    max_prompt_tokens: int = 131072
    # Prompt and response tokens of one sample: the model's positions, past which it never ran.
    max_positions: int | None = None
    # Keys in one `meta` map.
    max_meta_keys: int = 64
    # Approximate size of one `meta` map: string lengths plus 8 per non-string value.
    max_meta_bytes: int = 16384
    # Token ids (prompt and response) must lie in [0, vocab_size): the model's embedding rows,
    # which an id outside them would index past. None checks only that none is negative.
    vocab_size: int | None = None
    # Routed experts (MoE models): ids must lie in [0, num_experts), and each token's routing
    # must have `moe_layers` rows of `moe_top_k` ids. None checks only that the samples of a
    # group agree with each other.
    num_experts: int | None = None
    moe_layers: int | None = None
    moe_top_k: int | None = None

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if value is not None and value < 1:
                raise ValueError(f"Limits.{f.name} must be >= 1, got {value}")


DEFAULT_LIMITS = Limits()


# The wire types are slotted but not frozen: a frozen __init__ costs about 2 µs more per object,
# a large share of decoding a group. eq=False because array fields have no single truth value.
# --8<-- [start:sample]
@dataclass(slots=True, eq=False)
class Sample:
    """One generated response of a group."""

    # Generated token ids, int32.
    response_ids: np.ndarray
    # Behaviour log-prob of each response token under the distribution actually sampled from
    # (after temperature/top-p), float32, finite and <= 0.
    logprobs: np.ndarray
    # Policy version whose weights produced each token's logits, int32, non-decreasing (an engine
    # that swaps weights mid-sequence gives later tokens the newer version).
    versions: np.ndarray
    # Scalar reward from the verifier; finite.
    reward: float
    # Why generation ended: "stop" (EOS/stop string), "length" (token budget), "abort" (cut short).
    finish: Finish
    # Small flat map of scalars for diagnostics (verifier details, turn count); not trained on.
    meta: dict[str, MetaValue] = field(default_factory=dict)
    # uint8, 1 for tokens the policy generated and is trained on, 0 for observation tokens an
    # environment inserted in multi-turn episodes (those carry logprob 0 and still a version).
    # None means every response token is trained on; it is then absent from the wire.
    loss_mask: np.ndarray | None = None
    # float32, the log-prob of each response token recomputed by the worker's mismatch audit
    # (`rollout.audit_fraction`): the same weights as `logprobs`, through the trainer's forward
    # path, finite and <= 0 (0 on observation tokens). None means not audited; absent from the
    # wire then (and in entries of writers that predate it).
    audit_logprobs: np.ndarray | None = None
    # uint16 [prompt + response tokens − 1, MoE layers, top-k]: the experts the engine routed
    # each token it fed through the model to, per MoE layer (the last response token is never
    # fed). Row p is input position p of prompt + response, so the trainer can replay the
    # routing (`algo.routing_replay`). On the wire: `routed_experts` (the ids, little-endian)
    # and `routed_shape` ([layers, top-k]). None: not captured; absent from the wire then.
    routed_experts: np.ndarray | None = None


# --8<-- [end:sample]


# --8<-- [start:trajectory]
@dataclass(slots=True, eq=False)
class TrajectoryGroup:
    """All samples generated for one prompt: one entry of the `trajectories` stream."""

    # Run id; a reader may reject groups of another run.
    run: str
    # Id of the `prompts` stream entry this group answers (what the trainer acks upstream).
    group_id: str
    # Dataset id of the prompt, stable across restarts and re-releases.
    prompt_id: str
    # Trainer version when the prompt was released. Tokens may carry newer versions (weights
    # swapped after release), never older ones in practice, but only versions >= 0 are enforced.
    release_version: int
    # Id of the rollout worker that generated the group.
    worker: str
    # Unix seconds when the worker took the prompt, and when the last sample finished.
    created_at: float
    finished_at: float
    # Prompt token ids, int32, shared by all samples.
    prompt_ids: np.ndarray
    # The n responses, in generation order; at least one (a group of none trains nothing).
    samples: list[Sample]
    # Wire schema version: the format `encode_group` writes (1 or 2); readers reject any other.
    schema: int = SCHEMA_VERSION

    @property
    def min_version(self) -> int:
        """Oldest version among all response tokens, which is what staleness is measured from.

        A group without response tokens has nothing stale in it; it reports `release_version`, so
        it ages like any other group released at the same time.
        """
        # The ufunc itself: ndarray.min's Python wrapper costs more than a short sample's pass.
        mins = [int(np.minimum.reduce(s.versions)) for s in self.samples if len(s.versions)]
        return min(mins) if mins else self.release_version

    @property
    def num_tokens(self) -> int:
        """Response tokens over all samples (prompt tokens not counted)."""
        return sum(len(s.response_ids) for s in self.samples)


# --8<-- [end:trajectory]


# --8<-- [start:prompt]
@dataclass(slots=True, eq=False)
class PromptGroup:
    """One entry of the `prompts` stream: a prompt to sample `n` responses for."""

    # Run id.
    run: str
    # Dataset id of the prompt, stable across restarts and re-releases.
    prompt_id: str
    # Prompt text as the dataset gives it (chat template not applied); may be empty if
    # `prompt_ids` is given.
    prompt: str
    # Prompt token ids, int32; empty means the worker tokenizes `prompt` itself.
    prompt_ids: np.ndarray
    # Reference answer handed to the verifier; empty when the task has none. Any other plain
    # value (number, bool, list, string-keyed map: see `plain_value_problem`) travels as JSON
    # text in the `answer_json` field, beside an empty `answer`.
    answer: Any
    # Task name, selecting the verifier/environment.
    task: str
    # Number of samples to generate, 1..max_samples.
    n: int
    # Trainer version when the prompt was released, >= 0.
    release_version: int
    # Small flat map of scalars the verifier or environment may need.
    meta: dict[str, MetaValue] = field(default_factory=dict)
    # Wire schema version; readers reject any other.
    schema: int = PROMPT_SCHEMA


# --8<-- [end:prompt]
