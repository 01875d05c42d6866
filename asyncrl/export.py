"""`asyncrl export RUN_DIR`: the trained model of a run's latest checkpoint, for other tools.

A LoRA run exports its adapter as a peft directory (`adapter_config.json`,
`adapter_model.safetensors`, the tokenizer), or with `--merge` the adapter folded into the base
as a plain Hugging Face model directory. A full fine-tune's checkpoint already is such a
directory: its model and tokenizer files are copied (`--merge` changes nothing).
Optimizer, RNG and run state stay behind.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from asyncrl.trainer.checkpoint import list_checkpoints

_RUN_STATE = {"optimizer.pt", "rng.pt", "trainer_state.json"}


def export(run_dir: Path, out: Path, *, merge: bool) -> Path:
    """Write the latest checkpoint's model to `out` (created; must not hold a model yet)."""
    from asyncrl.lora import base_of, is_adapter_dir

    ckpts = list_checkpoints(run_dir / "checkpoints")
    if not ckpts:
        raise SystemExit(f"{run_dir}/checkpoints holds no complete checkpoint")
    latest = ckpts[-1]
    if out.exists() and any(out.iterdir()):
        raise SystemExit(f"--out {out} is not empty")
    out.mkdir(parents=True, exist_ok=True)
    if is_adapter_dir(latest) and merge:
        import torch
        from peft import PeftModel
        from transformers import AutoModelForCausalLM

        base = AutoModelForCausalLM.from_pretrained(base_of(latest), dtype=torch.float32)
        merged = PeftModel.from_pretrained(base, latest).merge_and_unload()
        merged.save_pretrained(out, safe_serialization=True)
        files = [f for f in latest.iterdir() if "token" in f.name]
    else:
        files = [f for f in latest.iterdir() if f.is_file() and f.name not in _RUN_STATE]
    for f in files:
        shutil.copy2(f, out / f.name)
    return out


def main(run_dir: str, out: str | None, merge: bool) -> int:
    path = export(Path(run_dir), Path(out) if out else Path(run_dir) / "export", merge=merge)
    print(path, file=sys.stdout)
    return 0
