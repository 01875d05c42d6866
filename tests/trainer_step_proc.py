"""One rank of a data-parallel `train_step` run, and the fixed batch both sides train on.

    python tests/trainer_step_proc.py RANK WORLD STORE_FILE OUT_DIR PARALLEL

Joins a gloo group through a FileStore, trains every case of `CASES` from the same initial
weights on this rank's share of `make_groups()` (split by groups, as the trainer splits them),
the model replicated (PARALLEL=ddp) or FSDP2-sharded (fsdp), and writes
`OUT_DIR/{case}-rank{RANK}.pt`: the updated parameters (full tensors; with fsdp on rank 0 only,
gathered as checkpoints gather them) and the step's figures; then `OUT_DIR/adamw-rank{RANK}.pt`
(`adamw_case`).
`tests/test_trainer_step.py` imports this module for the batch and the cases.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

from asyncrl.algo.config import AlgoConfig
from asyncrl.engines.config import SamplingParams
from asyncrl.protocol import Sample, TrajectoryGroup
from asyncrl.tiny_model import new_tiny_model
from asyncrl.trainer.batch import Row, group_rows
from asyncrl.trainer.builder import adamw_kernel
from asyncrl.trainer.parallel import full_state, shard
from asyncrl.trainer.step import StepStats, train_step

N_GROUPS = 4
N_SAMPLES = 4
CURRENT_VERSION = 3
SAMPLING = SamplingParams(temperature=0.8, max_new_tokens=24)
# name: (algo overrides, micro_batch_tokens). 24 tokens split rank 0's long rows over more
# micro-batches than rank 1's short ones, so the ranks run different micro-batch counts.
CASES: dict[str, tuple[dict[str, Any], int]] = {
    "token-mean-one-mb": ({"aggregation": "token-mean"}, 100_000),
    "token-mean-small-mb": ({"aggregation": "token-mean"}, 24),
    "seq-mean-token-mean-small-mb": ({"aggregation": "seq-mean-token-mean"}, 24),
    "seq-mean-token-sum-norm-small-mb": ({"aggregation": "seq-mean-token-sum-norm"}, 24),
    "seq-mean-token-sum-horizon-small-mb": ({"aggregation": "seq-mean-token-sum-horizon"}, 24),
    # Masking drops tokens from the loss and its normalisers after each forward: the trainer
    # rescales the gradients by the global kept counts (tokens, then non-empty rows).
    "mask-token-mean-small-mb": ({"correction": "mask"}, 24),
    "mask-seq-mean-token-mean-small-mb": (
        {"correction": "mask", "aggregation": "seq-mean-token-mean"},
        24,
    ),
    # A KL term to a frozen reference model (another seed), sharded like the policy under fsdp.
    "kl-loss-small-mb": ({"kl_coef": 0.5, "kl_in": "loss"}, 24),
    # The same with the head in chunks of 5 tokens (`trainer.logits_chunk_tokens`), the policy's
    # and the reference's: the tiny model's embedding is tied, so its one gradient is assembled
    # by the head and the lookup — inside FSDP's gathered root under fsdp.
    "chunked-head-kl-small-mb": ({"kl_coef": 0.5, "kl_in": "loss"}, 24),
}
CHUNKED = {"chunked-head-kl-small-mb": 5}
"""`trainer.logits_chunk_tokens` of the cases that set one (the others: whole logits)."""


def make_groups() -> list[TrajectoryGroup]:
    """Groups 0-1 (rank 0 of 2) hold long responses, groups 2-3 (rank 1) short ones; one group
    per rank mixes versions (lag 0 and older); rewards vary within each group."""
    rng = np.random.default_rng(1234)
    groups = []
    for g in range(N_GROUPS):
        lo, hi = (12, 22) if g < N_GROUPS // 2 else (2, 5)
        samples = []
        for s in range(N_SAMPLES):
            n = int(rng.integers(lo, hi))
            versions = np.full(n, CURRENT_VERSION, np.int32)
            if g % 2:
                versions[: n // 2] = CURRENT_VERSION - 1
            samples.append(
                Sample(
                    response_ids=rng.integers(3, 15, n).astype(np.int32),
                    logprobs=-rng.uniform(0.5, 4.0, n).astype(np.float32),
                    versions=versions,
                    reward=float((s + g) % 2) + 0.25 * s,
                    finish="length",
                )
            )
        groups.append(
            TrajectoryGroup(
                run="step",
                group_id=f"{g}-0",
                prompt_id=str(g),
                release_version=CURRENT_VERSION - 1,
                worker="w",
                created_at=0.0,
                finished_at=0.0,
                prompt_ids=np.array([1, *rng.integers(3, 15, 4 + g)], np.int32),
                samples=samples,
            )
        )
    return groups


def step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    rows: list[Row],
    algo: AlgoConfig,
    micro_batch_tokens: int = 100_000,
    **more: Any,
) -> StepStats:
    """`train_step` at the tests' sampling and current version, gradients clipped at 1."""
    return train_step(
        model,
        optimizer,
        rows,
        algo=algo,
        sampling=SAMPLING,
        micro_batch_tokens=micro_batch_tokens,
        grad_clip=1.0,
        current_version=CURRENT_VERSION,
        **more,
    )


def run_case(
    name: str,
    groups: list[TrajectoryGroup],
    world: torch.distributed.ProcessGroup | None,
    parallel: str = "ddp",
    micro_batch_tokens: int | None = None,
) -> dict[str, Any]:
    """Train one step of case `name` on `groups` from the seed-0 tiny model (with the case's
    micro-batch size unless `micro_batch_tokens` is given)."""
    overrides, case_micro_batch_tokens = CASES[name]
    micro_batch_tokens = micro_batch_tokens or case_micro_batch_tokens
    algo = AlgoConfig(**overrides)
    torch.manual_seed(0)
    model = new_tiny_model(seed=0)
    ref_model = new_tiny_model(seed=2).requires_grad_(False) if algo.kl_coef else None
    if parallel == "fsdp":
        assert world is not None
        for module in (model, ref_model):
            if module is not None:
                shard(module, torch.device("cpu"), world.size())
    # SGD: the update is linear in the gradient, so weights agree as closely as gradients do.
    # (Adam's first step is about lr·sign(g): float rounding of a gradient near 0 would flip it.)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    rows = group_rows(groups, algo, SAMPLING.max_new_tokens)
    stats = step(
        model,
        optimizer,
        rows,
        algo,
        micro_batch_tokens,
        ref_model=ref_model,
        world=world,
        logits_chunk_tokens=CHUNKED.get(name, 0),
    )
    if parallel == "fsdp":
        params = full_state(model, optimizer)[0]
    else:
        params = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return {
        "params": params,
        "loss": stats.loss,
        "grad_norm": stats.grad_norm,
        "tokens": stats.tokens,
        "lag0_tokens": stats.lag0_tokens,
        "diff": stats.logprob_abs_diff_lag0,
        "weight_mean": stats.behaviour_weight_mean,
        "mismatch_by_prob": stats.mismatch.by_prob,
        "mismatch_by_position": stats.mismatch.by_position,
    }


def adamw_case(
    groups: list[TrajectoryGroup], world: torch.distributed.ProcessGroup, parallel: str
) -> dict[str, Any]:
    """Three AdamW steps from the seed-0 tiny model, with torch's for-loop kernel and with the
    kernel the trainer builds (`adamw_kernel`): the weights of each, and the trainer's flags."""
    out: dict[str, Any] = {}
    for kernel in ("for_loop", "trainer"):
        torch.manual_seed(0)
        model = new_tiny_model(seed=0)
        if parallel == "fsdp":
            shard(model, torch.device("cpu"), world.size())
        params = list(model.parameters())
        flags = {"foreach": False} if kernel == "for_loop" else adamw_kernel(params)
        optimizer = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01, **flags)
        rows = group_rows(groups, AlgoConfig(), SAMPLING.max_new_tokens)
        for _ in range(3):
            step(model, optimizer, rows, AlgoConfig(), world=world)
        out[kernel] = (
            full_state(model, optimizer)[0]
            if parallel == "fsdp"
            else {k: v.detach().clone() for k, v in model.state_dict().items()}
        )
        out[f"{kernel}_flags"] = flags
    return out


def main(rank: int, world_size: int, store_file: str, out_dir: Path, parallel: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    store = dist.FileStore(store_file, world_size)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
    groups = make_groups()
    per_rank = len(groups) // world_size
    mine = groups[rank * per_rank : (rank + 1) * per_rank]
    try:
        for name in CASES:
            result = run_case(name, mine, dist.group.WORLD, parallel)
            torch.save(result, out_dir / f"{name}-rank{rank}.pt")
        adamw = adamw_case(mine, dist.group.WORLD, parallel)
        torch.save(adamw, out_dir / f"adamw-rank{rank}.pt")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], Path(sys.argv[4]), sys.argv[5])
