"""End to end with `model.lora`: `asyncrl launch --role all` on the warmed quickstart model trains
an adapter only, synced by broadcast, and learns — held-out accuracy at the end of the run
passes the same evaluation of the model it started from by MARGIN; every lag-0 log-prob in the
engine (adapter applied) is the trainer's; the accounting balances; the checkpoints hold the
adapter; `asyncrl export --merge` writes a model that transformers loads."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from asyncrl.trainer.checkpoint import list_checkpoints

from role_procs import Launched, asyncrl, check_accounting

pytestmark = [pytest.mark.timeout(900), pytest.mark.slow]

STEPS = 40
GROUPS = 32
EVAL = ("trainer.eval_every=5", "trainer.eval_size=200", "trainer.eval_samples=4")
"""Held-out accuracy sampled at T = 1: what the policy earns (greedy, the warmed model already
reads 0.70 and RL here mostly sharpens it). 800 answers an eval bound its sampling noise to about
±0.02 (1 σ), against ±0.035 for one answer a question: with that noise and the run-to-run
spread of async training, a fixed threshold at two evals in a row (0.55, the run reading
0.52-0.66) once failed in CI."""
MARGIN = 0.2
"""Gain over the start that the mean of the last three evals (steps 30-40) must show. Measured
over 6 runs on 2 loaded cores (docs/reliability.md, issue 28): the start reads 0.239 in every
run (the warmed model and the evaluator's seed are fixed); the mean of the last three, 0.566-
0.614: gains 0.327-0.375 (mean 0.354, σ 0.019), so the margin sits 8 σ below the mean gain and
0.13 below the smallest. Left to the async schedule, single evals still wander by ±0.05."""
LORA = (
    "model.lora.rank=8",
    "model.lora.alpha=16",
    "model.lora.target_modules=all-linear",
    "trainer.lr=5e-3",
)


def test_quickstart_with_lora_learns(launched: Launched, warm_model: Path) -> None:
    run = launched(
        "e2e-lora",
        *LORA,
        f"trainer.max_steps={STEPS}",
        f"trainer.groups_per_step={GROUPS}",
        "trainer.lr_decay=none",
        *EVAL,
        "rollout.n=8",
        "rollout.prompts_per_batch=32",
        "algo.max_staleness=1",
    )
    lines = [json.loads(x) for x in (run.dir / "metrics.jsonl").read_text().splitlines()]
    acc = [line["eval_accuracy"] for line in lines if "eval_accuracy" in line]
    assert len(acc) == STEPS // 5
    start = held_out_accuracy(run.dir / "config.yaml", warm_model)
    assert statistics.mean(acc[-3:]) >= start + MARGIN, (start, acc)
    diffs = [s["behaviour_logprob_abs_diff_lag0"] for s in run.steps]
    measured = [d for d in diffs if d is not None]
    assert measured and max(measured) < 1e-5, diffs
    check_accounting(run, STEPS, GROUPS)

    ckpt = list_checkpoints(run.dir / "checkpoints")[-1]
    assert (ckpt / "adapter_model.safetensors").is_file()
    assert not (ckpt / "model.safetensors").exists()
    out = run.dir.parent / "merged"
    proc = asyncrl("export", str(run.dir), "--merge", "--out", str(out))
    assert proc.returncode == 0, proc.stderr

    from transformers import AutoModelForCausalLM

    merged = AutoModelForCausalLM.from_pretrained(out)
    assert sum(p.numel() for p in merged.parameters()) > 0


def held_out_accuracy(config: Path, model: Path) -> float:
    """The run's held-out evaluation (its config, its `Evaluator`) of `model`: what the trainer
    would log before its first step, the adapter being zero then."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from asyncrl.config import load_config
    from asyncrl.evaluate import Evaluator
    from asyncrl.tasks.build import build_task

    cfg = load_config(config)
    tokenizer = AutoTokenizer.from_pretrained(model)
    task = build_task(cfg.task, tokenizer)
    accuracy = Evaluator(AutoModelForCausalLM.from_pretrained(model), tokenizer, task, cfg).reward()
    assert accuracy is not None
    return accuracy
