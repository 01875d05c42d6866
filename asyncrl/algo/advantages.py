"""Outcome-reward advantages and reward shaping for group sampling (GRPO family, DAPO).

All functions take flat per-sample tensors. A *group* is the set of samples drawn for one
prompt, marked by equal entries of ``group_ids`` (any integer labels, in any order). Group
statistics use scatter ops, so the cost is O(N) with no Python loop over samples or groups.
"""

from __future__ import annotations

import torch
from torch import Tensor


def _groups(rewards: Tensor, group_ids: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Validate inputs; return float rewards, each sample's dense group index, group sizes."""
    if rewards.dim() != 1 or rewards.shape != group_ids.shape:
        raise ValueError(
            f"rewards and group_ids must be 1-D of equal length, got "
            f"{tuple(rewards.shape)} and {tuple(group_ids.shape)}"
        )
    if not rewards.is_floating_point():
        rewards = rewards.to(torch.get_default_dtype())
    _, inverse, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)
    return rewards, inverse, counts


def _group_sum(values: Tensor, inverse: Tensor, n_groups: int) -> Tensor:
    return values.new_zeros(n_groups).index_add_(0, inverse, values)


def grpo_advantages(
    rewards: Tensor, group_ids: Tensor, *, norm_by_std: bool = True, eps: float = 1e-6
) -> Tensor:
    """GRPO advantage ``(r_i - mean_g) / (std_g + eps)`` with the unbiased (N-1) std.

    ``norm_by_std=False`` gives Dr.GRPO, ``r_i - mean_g``. This is verl's
    ``compute_grpo_outcome_advantage`` (``adv_estimator=grpo``, ``norm_adv_by_std_in_grpo``,
    ``epsilon``): ``torch.std`` is the unbiased one, and a group of one sample has mean 0 and
    std 1, so its advantage is its raw reward (divided by ``1 + eps``). verl's
    ``grpo_vectorized`` differs only in flooring the variance at ``eps``.

    Example: rewards ``[1, 0, 1, 0]`` in one group have mean 0.5 and std 0.57735, so
    ``A = [0.866, -0.866, 0.866, -0.866]``; with ``norm_by_std=False``, ``[0.5, -0.5, ...]``.
    """
    rewards, inverse, counts = _groups(rewards, group_ids)
    n = counts.to(rewards.dtype)
    mean = _group_sum(rewards, inverse, len(counts)) / n
    deviation = rewards - mean[inverse]
    lone = counts[inverse] == 1
    centred = torch.where(lone, rewards, deviation)
    if not norm_by_std:
        return centred
    var = _group_sum(deviation.square(), inverse, len(counts)) / (n - 1).clamp(min=1)
    std = torch.where(lone, torch.ones_like(rewards), var.sqrt()[inverse])
    return centred / (std + eps)


def rloo_advantages(rewards: Tensor, group_ids: Tensor) -> Tensor:
    """REINFORCE leave-one-out: ``A_i = r_i - mean of the other samples of i's group``.

    verl's ``compute_rloo_outcome_advantage`` writes it ``(n r_i - Σ_g r) / (n - 1)``, the
    same value. A group of one sample has no leave-one-out baseline; its advantage is 0 (no
    gradient), as in verl's ``rloo_vectorized`` and SkyRL; verl's ``rloo`` leaves the raw
    reward there instead, an unbaselined REINFORCE term whose scale does not match the rest
    of the batch.

    Example: rewards ``[1, 2, 3]`` in one group give ``[1 - 2.5, 2 - 2, 3 - 1.5]``.
    """
    rewards, inverse, counts = _groups(rewards, group_ids)
    n = counts[inverse].to(rewards.dtype)
    others = (_group_sum(rewards, inverse, len(counts))[inverse] - rewards) / (n - 1).clamp(min=1)
    return torch.where(n > 1, rewards - others, torch.zeros_like(rewards))


def zero_variance_mask(rewards: Tensor, group_ids: Tensor) -> Tensor:
    """Bool mask, True (keep) for samples whose group's rewards are not all equal.

    DAPO's dynamic-sampling filter: a group whose rewards are all equal, a one-sample group
    included, has zero group-relative advantage and so carries no learning signal. Exact
    min/max comparison, so equal rewards are never kept because of rounding in a variance.

    Example: rewards ``[1, 1, 0, 1]`` with groups ``[0, 0, 1, 1]`` give
    ``[False, False, True, True]``.
    """
    rewards, inverse, counts = _groups(rewards, group_ids)
    empty = rewards.new_empty(len(counts))
    hi = empty.scatter_reduce(0, inverse, rewards, "amax", include_self=False)
    lo = empty.scatter_reduce(0, inverse, rewards, "amin", include_self=False)
    return (hi > lo)[inverse]


def overlong_penalty(
    lengths: Tensor, max_len: int, buffer_len: int, penalty_factor: float = 1.0
) -> Tensor:
    """DAPO soft overlong punishment, a reward term in ``[-penalty_factor, 0]``.

    0 up to ``max_len - buffer_len`` tokens, then linear down to ``-penalty_factor`` at
    ``max_len``, and ``-penalty_factor`` beyond. The ramp tells the policy that length is
    costly before truncation cuts the answer off, instead of one cliff at ``max_len``.

    Example: ``max_len=20, buffer_len=4``: lengths ``[16, 18, 20, 25]`` give
    ``[0, -0.5, -1, -1]``.
    """
    if not 0 < buffer_len <= max_len:
        raise ValueError(f"need 0 < buffer_len <= max_len, got {buffer_len=}, {max_len=}")
    over = (lengths.to(torch.get_default_dtype()) - (max_len - buffer_len)) / buffer_len
    return -penalty_factor * over.clamp(0.0, 1.0)
