"""GRPO against GSPO on the tiny Qwen3-MoE, each with and without routing replay (R3), async at
staleness η with a bfloat16 engine; and the lag-0 gap and routing agreement of that engine.

    python tools/bench_moe.py [--steps 30] [--seeds 0 1 2] [--eta 2] [--out docs/bench_moe.png]

One process, no Redis: the project's builtin engine (`TorchEngine`, bf16, routing captured)
generates each step's groups with the weights of η steps before (every group at staleness η, the
bound of an async run), and the project's `train_step` trains an fp32 model on them — the same
code paths as a run, without the transport, so that 4 arms × seeds fit a CPU budget. Arms:

- `grpo`: `algo.loss=ppo`, token-level truncated behaviour weights;
- `gspo`: `algo.loss=gspo` (sequence-level ratio, seq-mean-token-mean), sequence-level weights;
- each with `algo.routing_replay` off and on.

With one optimizer step per batch the PPO/GSPO ratio against π_prox is 1 by construction (clip
fraction 0): the ratio that swings with the routing is the behaviour ratio π_prox/π_behav, whose
truncated weights the step reports (mean, p99, share at the cap). Prints one table of medians over
seeds (reward of the last third of the steps, weight statistics, |Δ log p|, agreement) and the
lag-0 table; `--out` plots the reward curves.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from asyncrl.algo.config import AlgoConfig
from asyncrl.algo.mismatch import RoutingAgreement
from asyncrl.engines.config import SamplingParams
from asyncrl.engines.torch_engine import TorchEngine
from asyncrl.protocol import Sample, TrajectoryGroup
from asyncrl.tasks.base import ArithmeticTask
from asyncrl.tasks.config import ArithmeticTaskConfig
from asyncrl.tiny_model import build_tiny_model
from asyncrl.trainer.batch import collate, group_rows
from asyncrl.trainer.step import token_logprobs, train_step

PARAMS = SamplingParams(temperature=1.0, max_new_tokens=4)
ARMS = {
    "grpo": dict(loss="ppo", correction_level="token"),
    "gspo": dict(
        loss="gspo",
        aggregation="seq-mean-token-mean",
        correction_level="sequence",
        clip_low=3e-4,
        clip_high=4e-4,
    ),
}


@dataclass
class Step:
    reward: float
    clip: float
    weight_mean: float
    weight_p99: float
    capped: float
    abs_diff: float
    agreement: float
    router: float


def engine_for(model: PreTrainedModel, dtype: torch.dtype, seed: int) -> TorchEngine:
    return TorchEngine(
        copy.deepcopy(model).to(dtype), eos_token_ids=[2], capture_routing=True, seed=seed
    )


def groups_of(
    engine: TorchEngine, task: ArithmeticTask, tokenizer: object, items: list, n: int
) -> list[TrajectoryGroup]:
    prompts = [item.prompt_ids for item in items for _ in range(n)]
    gens = engine.generate(prompts, PARAMS)
    texts = tokenizer.batch_decode(  # type: ignore[attr-defined]
        [g.token_ids.tolist() for g in gens], skip_special_tokens=True
    )
    out = []
    for i, item in enumerate(items):
        samples = [
            Sample(
                response_ids=g.token_ids,
                logprobs=g.logprobs,
                versions=g.versions,
                reward=task.score(item, text),
                finish=g.finish,
                routed_experts=g.routed_experts,
            )
            for g, text in zip(gens[i * n : (i + 1) * n], texts[i * n : (i + 1) * n], strict=True)
        ]
        out.append(
            TrajectoryGroup(
                run="bench",
                group_id=f"{i}",
                prompt_id=item.prompt_id,
                release_version=0,
                worker="bench",
                created_at=0.0,
                finished_at=0.0,
                prompt_ids=np.asarray(item.prompt_ids, np.int32),
                samples=samples,
            )
        )
    return out


def run_arm(
    model_dir: Path,
    arm: str,
    replay: bool,
    seed: int,
    steps: int,
    eta: int,
    groups: int,
    n: int,
    lr: float = 1e-3,
) -> list[Step]:
    torch.manual_seed(seed)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    task = ArithmeticTask(ArithmeticTaskConfig(digits=2), tokenizer)
    engine = engine_for(model, torch.bfloat16, seed)
    names = list(engine.state_dict_for_sync())
    snapshots = {0: {k: v.detach().clone() for k, v in model.state_dict().items() if k in names}}
    algo = AlgoConfig(routing_replay=replay, max_staleness=eta, **ARMS[arm])  # type: ignore[arg-type]
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    items = task.train_items(seed, 0)
    out = []
    for step in range(steps):
        behind = max(0, step - eta)  # the version an async run at the bound generates with
        if behind > engine.version:
            engine.stage_weights(
                {k: v.to(torch.bfloat16) for k, v in snapshots.pop(behind).items()}, behind
            )
        batch = groups_of(engine, task, tokenizer, items[step * groups : (step + 1) * groups], n)
        rows = group_rows(batch, algo, PARAMS.max_new_tokens)
        stats = train_step(
            model,
            optimizer,
            rows,
            algo=algo,
            sampling=PARAMS,
            micro_batch_tokens=8192,
            grad_clip=1.0,
            current_version=step,
        )
        snapshots[step + 1] = {
            k: v.detach().clone() for k, v in model.state_dict().items() if k in names
        }
        p99 = stats.weight_quantiles[2] if stats.weight_quantiles else float("nan")
        routing = stats.routing
        out.append(
            Step(
                reward=float(np.mean([s.reward for g in batch for s in g.samples])),
                clip=stats.clip_fraction,
                weight_mean=stats.behaviour_weight_mean,
                weight_p99=p99,
                capped=stats.behaviour_weight_capped_fraction,
                abs_diff=stats.mismatch.abs_diff_mean() or float("nan"),
                agreement=(routing.mean() if routing is not None else None) or float("nan"),
                router=(routing.mean(router=True) if routing is not None else None) or float("nan"),
            )
        )
    return out


def lag0(model_dir: Path, dtype: torch.dtype, prompts: int = 64) -> dict[str, float]:
    """The engine's lag-0 gap to the trainer (fp32) and the routing agreement, replay off/on."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    task = ArithmeticTask(ArithmeticTaskConfig(digits=2), tokenizer)
    engine = engine_for(model, dtype, 0)
    batch = groups_of(engine, task, tokenizer, list(task.eval_items()[:prompts]), 4)
    mb = collate(group_rows(batch, AlgoConfig(filter_zero_variance=False), 4))
    out = {}
    for replay in (False, True):
        agreement = RoutingAgreement.empty(2)
        with torch.no_grad():
            logp = token_logprobs(model, mb, PARAMS, replay=replay, agreement=agreement)
        gap = (logp - mb.behav_logp).abs() * mb.mask
        key = "on" if replay else "off"
        out[f"gap_mean_{key}"] = float(gap.sum() / mb.mask.sum())
        out[f"gap_max_{key}"] = float(gap.max())
        out[f"agreement_{key}"] = agreement.mean() or float("nan")
        out[f"router_agreement_{key}"] = agreement.mean(router=True) or float("nan")
    out["tokens"] = agreement.tokens
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="runs/models/tiny-add2-moe", help="built if absent")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--eta", type=int, default=2)
    ap.add_argument("--groups", type=int, default=16, help="prompt groups per step")
    ap.add_argument("--n", type=int, default=8, help="samples per group")
    ap.add_argument("--lr", type=float, default=1e-3, help="constant (the quickstart's peak)")
    ap.add_argument("--out", default=None, help="PNG of the reward curves")
    args = ap.parse_args()
    torch.set_num_threads(1)
    model_dir = Path(args.model)
    build_tiny_model(model_dir, moe=True)

    print("lag 0, trainer float32, 64 prompts x 4 samples (|Δ log p| over response tokens):")
    print(f"  {'engine':>9} {'gap off':>9} {'gap on':>9} {'max off':>9} {'max on':>9} "
          f"{'agree off':>9} {'agree on':>9} {'router on':>9}")  # fmt: skip
    for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        r = lag0(model_dir, dtype)
        print(
            f"  {name:>9} {r['gap_mean_off']:9.2e} {r['gap_mean_on']:9.2e} {r['gap_max_off']:9.2e}"
            f" {r['gap_max_on']:9.2e} {r['agreement_off']:9.5f} {r['agreement_on']:9.5f}"
            f" {r['router_agreement_on']:9.5f}"
        )

    curves: dict[str, list[list[Step]]] = {}
    for arm in ARMS:
        for replay in (False, True):
            key = f"{arm}{' +R3' if replay else ''}"
            for seed in args.seeds:
                start = time.perf_counter()
                steps = run_arm(
                    model_dir, arm, replay, seed, args.steps, args.eta, args.groups, args.n, args.lr
                )
                curves.setdefault(key, []).append(steps)
                print(f"  {key} seed {seed}: {time.perf_counter() - start:.0f} s", flush=True)

    tail = max(1, args.steps // 3)
    print(
        f"\n{args.steps} steps, η={args.eta}, {args.groups}x{args.n} samples a step, bf16 engine, "
        f"seeds {args.seeds}; medians over seeds of per-run means (reward: first / last "
        f"{tail} steps, then the last's min and max over seeds)"
    )
    cols = ("reward0", "reward", "min", "max", "clip", "w_mean", "w_p99", "capped", "|Δlogp|")
    cols += ("agree", "router")
    print(f"  {'arm':>9} " + " ".join(f"{c:>8}" for c in cols))
    for key, runs in curves.items():

        def med(values: list[float]) -> float:
            return statistics.median(values)

        first = med([float(np.mean([s.reward for s in r[:tail]])) for r in runs])
        lasts = [float(np.mean([s.reward for s in r[-tail:]])) for r in runs]
        fields = ("clip", "weight_mean", "weight_p99", "capped", "abs_diff", "agreement", "router")
        row = [first, med(lasts), min(lasts), max(lasts)] + [
            med([float(np.nanmean([getattr(s, f) for s in r])) for r in runs]) for f in fields
        ]
        print(f"  {key:>9} " + " ".join(f"{v:8.4f}" for v in row))

    if args.out:
        from matplotlib.figure import Figure

        fig = Figure(figsize=(8, 4.5), layout="constrained")
        ax = fig.subplots()
        for key, runs in curves.items():
            rewards = np.array([[s.reward for s in r] for r in runs])
            x = np.arange(1, rewards.shape[1] + 1)
            (line,) = ax.plot(x, np.median(rewards, 0), label=key)
            ax.fill_between(x, rewards.min(0), rewards.max(0), alpha=0.15, color=line.get_color())
        ax.set_xlabel("step")
        ax.set_ylabel("mean reward of the step's samples")
        ax.set_title(f"tiny Qwen3-MoE, η={args.eta}, bf16 engine: median and range over seeds")
        ax.legend()
        ax.grid(alpha=0.3)
        fig.savefig(args.out, dpi=100)
        print(args.out)


if __name__ == "__main__":
    main()
