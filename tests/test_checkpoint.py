"""A full checkpoint disk: one clear line naming the folder, no half-written checkpoint left, the
previous checkpoint intact (`asyncrl/trainer/checkpoint.py`)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from checkpoint_proc import digests

PROC = Path(__file__).parent / "checkpoint_proc.py"


@pytest.mark.parametrize("fail_in", ["model.safetensors", "optimizer.pt"])
def test_a_full_disk_names_the_checkpoint_and_keeps_the_previous_one(
    fail_in: str, random_model: Path, tmp_path: Path
) -> None:
    """The write of step 2 fails in safetensors' writer or in torch.save's (which said only
    `basic_ios::clear: iostream error` or `unexpected pos`). The error is one line naming the
    folder and the likely full disk; `step_00000002.tmp` is gone and step 1 is byte for byte what
    it was, though `keep=1` would have deleted it after a complete step 2."""
    root = tmp_path / "checkpoints"
    proc = subprocess.run(
        [sys.executable, str(PROC), str(root), str(random_model), fail_in],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    error = report["error"]
    assert "\n" not in error
    assert str(root / "step_00000002.tmp") in error, error
    assert "disk full" in error and "MiB free" in error, error
    assert f"{root / 'step_00000001'} is intact" in error, error
    assert sorted(p.name for p in root.iterdir()) == ["step_00000001"]
    assert digests(root / "step_00000001") == report["before"]
