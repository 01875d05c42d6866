"""Validation: whether a decoded (or about to be encoded) message is safe to use, within
`Limits`, raising `ValidationError` with a stable reason otherwise."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from asyncrl.protocol.records import (
    DEFAULT_LIMITS,
    FINISH_CODES,
    FINISH_REASONS,
    PROMPT_SCHEMA,
    SCHEMA_VERSION,
    SCHEMA_VERSIONS,
    Limits,
    PromptGroup,
    TrajectoryGroup,
    ValidationError,
)

META_TYPES = frozenset({type(None), bool, int, float, str})

# Tokens of a group above which `validate_group` checks its arrays sample by sample rather than
# concatenated (decoding measured: concatenated is cheaper at 8 × 4 k tokens, split at 8 × 16 k).
CONCAT_MAX_TOKENS = 32768


def check_meta(meta: Any, limits: Limits, where: str) -> None:
    if type(meta) is not dict:
        raise ValidationError("malformed", f"{where}meta: expected a map")
    if len(meta) > limits.max_meta_keys:
        raise ValidationError(
            "too_large", f"{where}meta: {len(meta)} keys exceeds {limits.max_meta_keys}"
        )
    size = 0
    for key, value in meta.items():
        if type(key) is not str or type(value) not in META_TYPES:
            raise ValidationError(
                "malformed", f"{where}meta[{key!r}]: keys must be str and values scalars"
            )
        size += len(key) + (len(value) if type(value) is str else 8)
    if size > limits.max_meta_bytes:
        raise ValidationError(
            "too_large", f"{where}meta: about {size} bytes exceeds {limits.max_meta_bytes}"
        )


def ids_within(ids: np.ndarray, vocab: int | None) -> bool:
    """Whether every id lies in [0, vocab) (vocab None: is >= 0). Signed integers are read as
    unsigned, where a negative one is at least 2**(bits - 1): one pass, not a min and a max."""
    if ids.dtype.kind != "i":
        return bool(ids.min() >= 0 and (vocab is None or ids.max() < vocab))
    sign = 2 ** (8 * ids.dtype.itemsize - 1)
    unsigned = ids.view(ids.dtype.str.replace("i", "u"))
    return int(np.maximum.reduce(unsigned)) < (sign if vocab is None else min(vocab, sign))


def _logprobs_ok(values: np.ndarray) -> bool:
    """Whether all values are finite and <= 0, in two reductions that allocate nothing: NaN makes
    both fail, +inf and positives fail the max, -inf the min."""
    return bool(np.maximum.reduce(values) <= 0 and np.minimum.reduce(values) > -np.inf)


def _check_ids(
    ids: np.ndarray, limits: Limits, where: str, sample_of: Callable[[int], int] | None = None
) -> None:
    """Reject an id no model can embed: negative, or not below `limits.vocab_size`. `sample_of`
    maps an index into concatenated responses back to its sample, for the message."""
    vocab = limits.vocab_size
    if not len(ids) or ids_within(ids, vocab):
        return
    bad = ids < 0 if vocab is None else (ids < 0) | (ids >= vocab)
    first = int(np.argmax(bad))
    token = int(ids[first])
    if sample_of is not None:
        where = f"samples[{sample_of(first)}].{where}"
    why = "< 0" if token < 0 else f">= vocab size {vocab}"
    raise ValidationError("token_out_of_range", f"{where} has token id {token} {why}")


def check_header(g: TrajectoryGroup, n_samples: int, limits: Limits) -> None:
    """The checks on a group's own fields, before its samples'."""
    if g.schema not in SCHEMA_VERSIONS:
        raise ValidationError("schema", f"unknown schema {g.schema!r}, expected {SCHEMA_VERSION}")
    if n_samples > limits.max_samples:
        raise ValidationError("too_large", f"{n_samples} samples exceeds {limits.max_samples}")
    if not n_samples:
        raise ValidationError("malformed", "group has no samples")
    if len(g.prompt_ids) > limits.max_prompt_tokens:
        raise ValidationError(
            "too_large", f"{len(g.prompt_ids)} prompt tokens exceeds {limits.max_prompt_tokens}"
        )
    if g.release_version < 0:
        raise ValidationError("version_negative", f"release_version {g.release_version} < 0")
    _check_ids(g.prompt_ids, limits, "prompt_ids")


def validate_group(
    g: TrajectoryGroup, *, current_version: int | None = None, limits: Limits | None = None
) -> None:
    """Raise `ValidationError` unless the group is safe to train on.

    Checks: known schema; sample, prompt and response sizes within `limits`; prompt and response
    token ids >= 0 and below `limits.vocab_size`; response_ids, logprobs, versions (and
    loss_mask, audit_logprobs) of equal length; logprobs and audit_logprobs finite and <= 0;
    versions >= 0, non-decreasing within each sample and, when `current_version` is given, not
    ahead of it; loss_mask 0/1; reward finite; finish known; meta flat and small; routed experts
    one row per fed token, of the model's layers × top-k, ids below its expert count. Token checks
    run once over all samples concatenated, so the cost does not grow with the number of
    samples in Python.
    """
    limits = limits or DEFAULT_LIMITS
    check_header(g, len(g.samples), limits)
    lengths = []
    for i, s in enumerate(g.samples):
        where = f"samples[{i}]."
        n = len(s.response_ids)
        if n > limits.max_response_tokens:
            raise ValidationError(
                "too_large", f"{where}response_ids: {n} tokens exceeds {limits.max_response_tokens}"
            )
        if limits.max_positions is not None and len(g.prompt_ids) + n > limits.max_positions:
            raise ValidationError(
                "too_large",
                f"{where}response_ids: {len(g.prompt_ids)} + {n} tokens pass "
                f"{limits.max_positions} positions",
            )
        if (
            len(s.logprobs) != n
            or len(s.versions) != n
            or (s.loss_mask is not None and len(s.loss_mask) != n)
            or (s.audit_logprobs is not None and len(s.audit_logprobs) != n)
        ):
            mask = "no" if s.loss_mask is None else len(s.loss_mask)
            audit = "no" if s.audit_logprobs is None else len(s.audit_logprobs)
            raise ValidationError(
                "length_mismatch",
                f"samples[{i}]: {n} response_ids, {len(s.logprobs)} logprobs, "
                f"{len(s.versions)} versions, {mask} loss_mask, {audit} audit_logprobs",
            )
        if not math.isfinite(s.reward):
            raise ValidationError("reward_not_finite", f"{where}reward is {s.reward}")
        if s.finish not in FINISH_REASONS:
            raise ValidationError(
                "finish", f"{where}finish {s.finish!r} not in {sorted(FINISH_REASONS)}"
            )
        check_meta(s.meta, limits, where)
        lengths.append(n)
    check_routing(g, limits)
    if not sum(lengths):
        return
    used = [s for s in g.samples if len(s.response_ids)]
    versions = [s.versions for s in used]
    # A short group's arrays are checked concatenated, one numpy call per check; a long group's
    # sample by sample on the decoded views, where a concatenation would copy (and fault in)
    # megabytes.
    columns = Columns(
        lengths=np.array(lengths),
        ids=[s.response_ids for s in used],
        logprobs=[s.logprobs for s in used],
        versions=versions,
        firsts=np.array([v[0] for v in versions]),
        lasts=np.array([v[-1] for v in versions]),
        audit_logprobs=[s.audit_logprobs for s in g.samples if s.audit_logprobs is not None],
        loss_masks=[s.loss_mask for s in g.samples if s.loss_mask is not None],
    )
    if sum(lengths) <= CONCAT_MAX_TOKENS:
        columns = columns.joined()
    check_tokens(columns, limits, current_version)


def check_bulk_samples(
    lengths: list[int],
    rewards: list[float],
    finish: list[int],
    metas: list[Any],
    n_prompt: int,
    limits: Limits,
) -> None:
    """The per-sample checks of `validate_group` but the token rules, on a bulk group's fields
    (an element per sample; `finish` as codes into `FINISH_CODES`)."""
    longest = max(lengths)
    if min(lengths) < 0:
        raise ValidationError("malformed", f"a sample has {min(lengths)} response tokens")
    if longest > limits.max_response_tokens:
        raise ValidationError(
            "too_large",
            f"samples[{lengths.index(longest)}].response_ids: {longest} tokens exceeds "
            f"{limits.max_response_tokens}",
        )
    if limits.max_positions is not None and n_prompt + longest > limits.max_positions:
        raise ValidationError(
            "too_large",
            f"samples[{lengths.index(longest)}].response_ids: {n_prompt} + {longest} tokens pass "
            f"{limits.max_positions} positions",
        )
    if not all(map(math.isfinite, rewards)):
        i = next(i for i, r in enumerate(rewards) if not math.isfinite(r))
        raise ValidationError("reward_not_finite", f"samples[{i}].reward is {rewards[i]}")
    if max(finish) >= len(FINISH_CODES):
        i = next(i for i, code in enumerate(finish) if code >= len(FINISH_CODES))
        raise ValidationError(
            "finish", f"samples[{i}].finish code {finish[i]} is not one of {list(FINISH_CODES)}"
        )
    for i, meta in enumerate(metas):
        check_meta(meta, limits, f"samples[{i}].")


@dataclass(slots=True)
class Columns:
    """A group's token arrays for `check_tokens`, as runs: either each one array over all
    samples (`joined`: the bulk wire format's, or concatenated), or one per sample."""

    # Response tokens of each sample, empty ones included.
    lengths: np.ndarray
    # Runs over the samples that have tokens.
    ids: list[np.ndarray]
    logprobs: list[np.ndarray]
    versions: list[np.ndarray]
    # First and last version of each sample that has tokens.
    firsts: np.ndarray
    lasts: np.ndarray
    # Runs over the samples that carry them.
    audit_logprobs: list[np.ndarray]
    loss_masks: list[np.ndarray]
    is_joined: bool = False

    def joined(self) -> Columns:
        def one(runs: list[np.ndarray]) -> list[np.ndarray]:
            return [np.concatenate(runs)] if runs else runs

        return Columns(
            self.lengths,
            one(self.ids),
            one(self.logprobs),
            one(self.versions),
            self.firsts,
            self.lasts,
            one(self.audit_logprobs),
            one(self.loss_masks),
            is_joined=True,
        )


def check_tokens(c: Columns, limits: Limits, current_version: int | None) -> None:
    """The token rules of `validate_group`, one numpy pass per run and rule; a failing rule
    names its sample."""

    def sample_of(flat_index: int) -> int:
        """The sample of a token of the concatenation, for an error message."""
        return int(np.searchsorted(np.cumsum(c.lengths), flat_index, side="right"))

    if not all(ids_within(r, limits.vocab_size) for r in c.ids):
        _check_ids(np.concatenate(c.ids), limits, "response_ids", sample_of)

    # Audited log-probs run the same checks as the behaviour ones, under the same reason codes.
    for a in c.audit_logprobs:
        if len(a) and not _logprobs_ok(a):
            if not np.isfinite(a).all():
                raise ValidationError("logprob_not_finite", "audit_logprobs has NaN or inf")
            raise ValidationError("logprob_positive", "audit_logprobs has a value > 0")
    if not all(_logprobs_ok(r) for r in c.logprobs):
        flat = np.concatenate(c.logprobs)
        finite = np.isfinite(flat)
        if not finite.all():
            i = sample_of(int(np.argmin(finite)))
            raise ValidationError("logprob_not_finite", f"samples[{i}].logprobs has NaN or inf")
        i = sample_of(int(np.argmax(flat > 0)))
        raise ValidationError("logprob_positive", f"samples[{i}].logprobs has a value > 0")

    # In a concatenation a decrease from one sample's end to the next one's start is none within
    # a sample: counting those from the samples' ends tells whether the one pass over the tokens
    # found any other. A non-decreasing sample has its extremes at its ends.
    between = int(np.count_nonzero(c.firsts[1:] < c.lasts[:-1])) if c.is_joined else 0
    decreasing = sum(int(np.count_nonzero(v[1:] < v[:-1])) for v in c.versions) != between
    joined = np.concatenate(c.versions) if decreasing or c.firsts.min() < 0 else None
    if joined is not None and joined.min() < 0:
        i = sample_of(int(np.argmin(joined)))
        raise ValidationError("version_negative", f"samples[{i}].versions has a value < 0")
    high = int(c.lasts.max()) if joined is None else int(joined.max())
    if current_version is not None and high > current_version:
        i = sample_of(int(np.argmax(np.concatenate(c.versions))))
        raise ValidationError(
            "version_ahead", f"samples[{i}].versions has {high} > current {current_version}"
        )
    if joined is not None and decreasing:
        # The first drop that does not fall on a sample's first token.
        drops = np.flatnonzero(joined[1:] < joined[:-1]) + 1
        starts = np.cumsum(c.lengths) - c.lengths
        i = sample_of(int(drops[~np.isin(drops, starts)][0]))
        raise ValidationError("versions_decreasing", f"samples[{i}].versions decrease")

    if any(len(m) and m.max() > 1 for m in c.loss_masks):
        raise ValidationError("loss_mask", "loss_mask values must be 0 or 1")


def check_routing(g: TrajectoryGroup, limits: Limits) -> None:
    """Routed experts: one row per fed token (prompt + response − 1), the same [layers, top-k]
    in every sample and as `limits` say, ids below `limits.num_experts`."""
    shapes = set()
    for i, s in enumerate(g.samples):
        r = s.routed_experts
        if r is None:
            continue
        fed = len(g.prompt_ids) + len(s.response_ids) - 1
        if r.ndim != 3 or len(r) != fed:
            raise ValidationError(
                "routing_shape",
                f"samples[{i}].routed_experts has shape {r.shape}, expected {fed} token rows",
            )
        shapes.add(r.shape[1:])
        if limits.num_experts is not None and r.size and int(r.max()) >= limits.num_experts:
            raise ValidationError(
                "routing_out_of_range",
                f"samples[{i}].routed_experts has expert {int(r.max())} >= {limits.num_experts}",
            )
    want = (limits.moe_layers, limits.moe_top_k)
    if len(shapes) > 1 or (shapes and None not in want and shapes != {want}):
        raise ValidationError(
            "routing_shape",
            f"routed_experts rows of {sorted(shapes)} (layers, top-k); the model has {want}",
        )


def validate_prompt(p: PromptGroup, *, limits: Limits | None = None) -> None:
    """Raise `ValidationError` unless the prompt group can be worked on."""
    limits = limits or DEFAULT_LIMITS
    if p.schema != PROMPT_SCHEMA:
        raise ValidationError("schema", f"unknown schema {p.schema!r}, expected {PROMPT_SCHEMA}")
    if p.n < 1:
        raise ValidationError("malformed", f"n={p.n}, must be >= 1")
    if p.n > limits.max_samples:
        raise ValidationError("too_large", f"n={p.n} exceeds {limits.max_samples}")
    if len(p.prompt_ids) > limits.max_prompt_tokens:
        raise ValidationError(
            "too_large", f"{len(p.prompt_ids)} prompt tokens exceeds {limits.max_prompt_tokens}"
        )
    if not p.prompt and not len(p.prompt_ids):
        raise ValidationError("malformed", "neither prompt text nor prompt_ids given")
    _check_ids(p.prompt_ids, limits, "prompt_ids")
    if p.release_version < 0:
        raise ValidationError("version_negative", f"release_version {p.release_version} < 0")
    check_meta(p.meta, limits, "")
