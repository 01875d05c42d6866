"""From trajectory groups to padded token tensors: one row per sample, aligned for next-token loss.

Row layout: `input_ids = prompt + response`. Prediction position `t` holds the logits of token
`t + 1`, so every per-token tensor here has length `L - 1` and a response token at absolute
position `p` sits at index `p - 1`. Padding is on the right: causal attention keeps the real
tokens' logits unaffected by it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from asyncrl.algo.advantages import (
    grpo_advantages,
    overlong_penalty,
    rloo_advantages,
    zero_variance_mask,
)
from asyncrl.algo.config import AlgoConfig
from asyncrl.algo.staleness import token_lag_keep
from asyncrl.protocol import TrajectoryGroup


@dataclass
class Row:
    """One sample ready to train on."""

    input_ids: np.ndarray  # int64 prompt + response
    n_prompt: int
    behav_logp: np.ndarray  # float32, one per response token
    versions: np.ndarray  # int32, one per response token
    loss_mask: np.ndarray  # float32, 1 for trained response tokens
    advantage: float
    reward: float
    routed: np.ndarray | None = None
    """uint16 [length − 1, MoE layers, k]: the rollout's experts of each fed token; None: not
    captured."""

    @property
    def length(self) -> int:
        return len(self.input_ids)


def group_rows(
    groups: list[TrajectoryGroup],
    algo: AlgoConfig,
    max_new_tokens: int,
    *,
    token_lag: tuple[int, int] | None = None,
) -> list[Row]:
    """Rows of every sample, advantages computed within each group.

    Rewards are shaped first (DAPO overlong penalty), then turned into advantages; groups whose
    rewards are all equal get their loss mask zeroed when `filter_zero_variance` is on, so they
    also leave the loss normalisers. `token_lag` = (trainer version, limit): tokens older than
    the limit leave the loss mask, and so its normalisers, too (`algo.staleness`).
    """
    samples = [(gi, s) for gi, g in enumerate(groups) for s in g.samples]
    if not samples:
        return []
    rewards = torch.tensor([s.reward for _, s in samples], dtype=torch.float64)
    gids = torch.tensor([gi for gi, _ in samples])
    if algo.overlong_buffer > 0:
        lengths = torch.tensor([len(s.response_ids) for _, s in samples])
        rewards = rewards + overlong_penalty(
            lengths, max_new_tokens, algo.overlong_buffer, algo.overlong_penalty
        ).to(rewards.dtype)
    if algo.advantage == "rloo":
        adv = rloo_advantages(rewards, gids)
    else:
        adv = grpo_advantages(rewards, gids, norm_by_std=algo.advantage == "grpo", eps=algo.eps)
    keep = (
        zero_variance_mask(rewards, gids)
        if algo.filter_zero_variance
        else torch.ones(len(samples), dtype=torch.bool)
    )
    rows = []
    for (gi, s), a, k in zip(samples, adv.tolist(), keep.tolist(), strict=True):
        prompt = groups[gi].prompt_ids
        mask = (
            np.ones(len(s.response_ids), np.float32)
            if s.loss_mask is None
            else s.loss_mask.astype(np.float32)
        )
        if token_lag is not None:
            mask = mask * token_lag_keep(s.versions, *token_lag)
        rows.append(
            Row(
                input_ids=np.concatenate([prompt, s.response_ids]).astype(np.int64),
                n_prompt=len(prompt),
                behav_logp=np.asarray(s.logprobs, np.float32),
                versions=np.asarray(s.versions, np.int32),
                loss_mask=mask * float(k),
                advantage=float(a),
                reward=float(s.reward),
                routed=s.routed_experts,
            )
        )
    return rows


@dataclass
class MicroBatch:
    """Right-padded tensors of some rows; per-token tensors have length L − 1."""

    input_ids: torch.Tensor  # [B, L]
    attention_mask: torch.Tensor  # [B, L]
    targets: torch.Tensor  # [B, L-1]
    mask: torch.Tensor  # [B, L-1] float, 1 on trained response tokens
    behav_logp: torch.Tensor  # [B, L-1]
    versions: torch.Tensor  # [B, L-1] int, -1 off the response
    advantages: torch.Tensor  # [B]
    routed: torch.Tensor | None = None  # [B, L, layers, k] the rollout's experts; None: no row has
    routed_mask: torch.Tensor | None = None  # [B, L] bool, the positions `routed` covers


def collate(rows: list[Row], device: torch.device | str = "cpu") -> MicroBatch:
    longest = max(r.length for r in rows)
    b = len(rows)
    ids = np.zeros((b, longest), np.int64)
    attn = np.zeros((b, longest), np.int64)
    mask = np.zeros((b, longest - 1), np.float32)
    behav = np.zeros((b, longest - 1), np.float32)
    vers = np.full((b, longest - 1), -1, np.int32)
    for i, r in enumerate(rows):
        ids[i, : r.length] = r.input_ids
        attn[i, : r.length] = 1
        lo, hi = r.n_prompt - 1, r.length - 1
        mask[i, lo:hi] = r.loss_mask
        behav[i, lo:hi] = r.behav_logp
        vers[i, lo:hi] = r.versions
    t = torch.from_numpy
    ids_t = t(ids).to(device)
    routed, routed_mask = _routed(rows, longest, device)
    return MicroBatch(
        input_ids=ids_t,
        attention_mask=t(attn).to(device),
        targets=ids_t[:, 1:],
        mask=t(mask).to(device),
        behav_logp=t(behav).to(device),
        versions=t(vers).to(device),
        advantages=torch.tensor([r.advantage for r in rows], dtype=torch.float32, device=device),
        routed=routed,
        routed_mask=routed_mask,
    )


def _routed(
    rows: list[Row], longest: int, device: torch.device | str
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The rows' recorded experts, right-padded like the tokens, and where they are known (every
    fed position of a row that has them; not a row's last token, which no engine fed)."""
    shape = next((r.routed.shape[1:] for r in rows if r.routed is not None), None)
    if shape is None:
        return None, None
    routed = np.zeros((len(rows), longest, *shape), np.int64)
    known = np.zeros((len(rows), longest), np.bool_)
    for i, r in enumerate(rows):
        if r.routed is not None:
            routed[i, : len(r.routed)] = r.routed
            known[i, : len(r.routed)] = True
    return torch.from_numpy(routed).to(device), torch.from_numpy(known).to(device)
