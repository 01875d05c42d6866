"""A checkpoint written to a disk that fills up (`tests/test_checkpoint.py`).

    python tests/checkpoint_proc.py ROOT TOKENIZER_DIR FAIL_IN

Writes checkpoint step 1 of the tiny model (AdamW state after one update), then lowers
RLIMIT_FSIZE so that the write of step 2 fails inside FAIL_IN (`model.safetensors`: safetensors'
writer; `optimizer.pt`: torch.save's), as a full disk fails it: past the limit write(2) returns
EFBIG instead of ENOSPC, with SIGXFSZ ignored. Prints one JSON object: the `CheckpointError`
message and the sha256 of step 1's files, taken before the failed write.
"""

from __future__ import annotations

import hashlib
import json
import resource
import signal
import sys
from pathlib import Path

import torch

from asyncrl.tiny_model import new_tiny_model
from asyncrl.trainer.checkpoint import CheckpointError, TrainerState, save_checkpoint
from asyncrl.trainer.parallel import full_state


def digests(folder: Path) -> dict[str, str]:
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(folder.iterdir())}


def main(root: Path, tokenizer_dir: Path, fail_in: str) -> int:
    torch.set_num_threads(1)
    model = new_tiny_model(seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(input_ids=torch.tensor([[1, 5, 6]])).logits.sum().backward()
    optimizer.step()

    def save(step: int) -> Path:
        state = TrainerState(step=step, version=step, cursor={"seed": 0}, wall_seconds=1.0)
        return save_checkpoint(
            root,
            model,
            *full_state(model, optimizer),
            state,
            tokenizer_dir=tokenizer_dir,
            keep=1,  # step 1 would be deleted once step 2 is complete
        )

    first = save(1)
    before = digests(first)
    sizes = {f.name: f.stat().st_size for f in first.iterdir()}
    # Room for every file smaller than FAIL_IN, and half of FAIL_IN.
    assert sizes["optimizer.pt"] > sizes["model.safetensors"]
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (sizes[fail_in] // 2, resource.RLIM_INFINITY))
    try:
        save(2)
    except CheckpointError as exc:
        print(json.dumps({"error": str(exc), "before": before}))
        return 0
    print(json.dumps({"error": None, "before": before}))
    return 1


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]))
