"""Time to 0.9 held-out accuracy: asyncrl's quickstart against a minimal synchronous GRPO loop.

    python tools/bench_quickstart.py [--config configs/quickstart.yaml] [--max-seconds 300]

Both start from the same warmed tiny model (built once, cached at the config's `model.path`),
use the same task, group size, prompts per step, optimizer and learning rate, and evaluate on
the same 500 held-out prompts sampled at temperature 1 every `trainer.eval_every` steps; eval
time counts against both. "Reached" means ≥ 0.9 on two consecutive evaluations; the time is the
wall time since training started (model building and process start-up excluded on both sides).

The minimal loop is the calibration baseline of the quickstart issue: one process, generate a
batch with the builtin engine, score, GRPO advantages, token-mean −A·logp, AdamW, repeat. It is
written here, not imported, so asyncrl's code paths do not flatter it. The two runs go one after
the other on the same machine; the last line is JSON with both times and their ratio.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from itertools import pairwise
from pathlib import Path

import torch

from asyncrl.config import load_config
from asyncrl.engines.sampling import sampling_logprobs
from asyncrl.engines.torch_engine import TorchEngine
from asyncrl.metrics.jsonl import read_jsonl
from asyncrl.metrics.record import EvalRecord, Record, StepRecord, read_record
from asyncrl.model import ensure_model
from asyncrl.tasks.build import build_task

TARGET = 0.9


def time_to_target(evals: list[tuple[float, float]]) -> float | None:
    """Wall seconds of the second of the first two consecutive evals ≥ TARGET."""
    for (_, a), (t, b) in pairwise(evals):
        if a >= TARGET and b >= TARGET:
            return t
    return None


def minimal_loop(cfg_path: str, max_seconds: float) -> tuple[float | None, list]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cfg = load_config(cfg_path)
    torch.set_num_threads(2)
    model_dir = ensure_model(cfg)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    task = build_task(cfg.task, tok)
    engine = TorchEngine(model, eos_token_ids=[tok.eos_token_id], seed=cfg.run.seed)
    params = cfg.rollout.sampling
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.trainer.lr)
    n, per_step = cfg.rollout.n, cfg.trainer.groups_per_step
    train = task.train_items(cfg.run.seed, 0)
    held_out = [task.eval_items()[i] for i in range(cfg.trainer.eval_size)]
    evals: list[tuple[float, float]] = []
    t0, pos, step = time.monotonic(), 0, 0
    while time.monotonic() - t0 < max_seconds:
        items = [train[(pos + i) % len(train)] for i in range(per_step)]
        pos += per_step
        prompts = [it.prompt_ids for it in items for _ in range(n)]
        gens = engine.generate(prompts, params)
        texts = tok.batch_decode([g.token_ids.tolist() for g in gens], skip_special_tokens=True)
        rewards = torch.tensor([task.score(items[i // n], t) for i, t in enumerate(texts)])
        r = rewards.view(per_step, n)
        adv = ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-6)).view(-1)
        seqs = [p + g.token_ids.tolist() for p, g in zip(prompts, gens, strict=True)]
        width = max(map(len, seqs))
        ids = torch.zeros(len(seqs), width, dtype=torch.long)
        mask = torch.zeros(len(seqs), width - 1)
        for i, (p, s) in enumerate(zip(prompts, seqs, strict=True)):
            ids[i, : len(s)] = torch.tensor(s)
            mask[i, len(p) - 1 : len(s) - 1] = 1
        model.train()
        logits = model(input_ids=ids).logits[:, :-1]
        logp = sampling_logprobs(logits, params).gather(-1, ids[:, 1:, None]).squeeze(-1)
        loss = -(adv[:, None] * logp * mask).sum() / mask.sum()
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.trainer.grad_clip)
        opt.step()
        step += 1
        if step % cfg.trainer.eval_every == 0:
            out = engine.generate([it.prompt_ids for it in held_out], params)
            answers = tok.batch_decode(
                [g.token_ids.tolist() for g in out], skip_special_tokens=True
            )
            acc = sum(task.score(it, a) for it, a in zip(held_out, answers, strict=True))
            evals.append((time.monotonic() - t0, acc / len(held_out)))
            if time_to_target(evals) is not None:
                break
    return time_to_target(evals), evals


def launch_all(
    cfg_path: str, timeout_s: float, *overrides: str, run_dir: Path | None = None
) -> list[Record]:
    """Run `asyncrl launch --role all` on `cfg_path` with `overrides` in `run_dir` (default: a
    temporary one); the records of its metrics.jsonl."""
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = run_dir or Path(tmp) / "run"
        launch = ["launch", "--role", "all", "--progress", "quiet", "--config"]
        cmd = [sys.executable, "-m", "asyncrl", *launch, cfg_path, f"run.dir={run_dir}", *overrides]
        subprocess.run(cmd, check=True, timeout=timeout_s, stdout=subprocess.DEVNULL)
        lines = read_jsonl(run_dir / "metrics.jsonl")
        return [r for r in map(read_record, lines) if r is not None]


def asyncrl_run(cfg_path: str, max_seconds: float) -> tuple[float | None, list, dict]:
    """Time to target, the evals, and where the time to target went (steps, waits)."""
    lines = launch_all(cfg_path, max_seconds + 120, "run.id=bench-quickstart")
    evals = [(r.wall_seconds or 0.0, r.eval_accuracy) for r in lines if isinstance(r, EvalRecord)]
    reached = time_to_target(evals)
    steps = [
        r for r in lines if isinstance(r, StepRecord) and (r.wall_seconds or 0) <= (reached or 0)
    ]
    spent = {
        "steps": len(steps),
        "step_s": sum(r.step_seconds or 0.0 for r in steps),
        "wait_s": sum(r.wait_seconds or 0.0 for r in steps),
    }
    return reached, evals, spent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="configs/quickstart.yaml")
    ap.add_argument("--max-seconds", type=float, default=300.0)
    args = ap.parse_args()
    ensure_model(load_config(args.config))
    a_s, a_evals, a_spent = asyncrl_run(args.config, args.max_seconds)
    m_s, m_evals = minimal_loop(args.config, args.max_seconds)
    print("asyncrl evals (s, acc):", [(round(t), round(a, 3)) for t, a in a_evals])
    print("minimal evals (s, acc):", [(round(t), round(a, 3)) for t, a in m_evals])
    if a_s is not None:
        rest = a_s - a_spent["step_s"] - a_spent["wait_s"]
        print(
            f"asyncrl to the target: {a_spent['steps']} steps, {a_spent['step_s']:.1f} s in "
            f"optimizer steps, {a_spent['wait_s']:.1f} s waiting for groups, {rest:.1f} s other "
            "(evals, checkpoints)"
        )
    if m_s is not None:
        every = load_config(args.config).trainer.eval_every
        m_steps = every * ([t for t, _ in m_evals].index(m_s) + 1)
        print(f"minimal to the target: {m_steps} steps, {m_s / m_steps:.3f} s each (all included)")
    ratio = a_s / m_s if a_s and m_s else None
    print(json.dumps({"asyncrl_s_to_0_9": a_s, "minimal_s_to_0_9": m_s, "ratio": ratio}))


if __name__ == "__main__":
    main()
