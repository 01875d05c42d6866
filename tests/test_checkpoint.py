"""A full checkpoint disk: one clear line naming the folder, no half-written checkpoint left, the
previous checkpoint intact (`asyncrl/trainer/checkpoint.py`)."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

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


def test_optimizer_state_resumes_as_the_distributed_loader_does_it_without_its_step() -> None:
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_optimizer_state_dict,
    )

    from asyncrl.trainer.parallel import full_state, load_optimizer_state

    def model_and_optimizer() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
        model[1].bias.requires_grad_(False)  # frozen: no optimizer state (a LoRA base)
        trainable = [p for p in model.parameters() if p.requires_grad]
        return model, torch.optim.AdamW(trainable, lr=1e-2)

    def step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        model(torch.ones(3, 4)).square().sum().backward()
        optimizer.step()
        optimizer.zero_grad()

    model, optimizer = model_and_optimizer()
    step(model, optimizer)
    model_state, optimizer_state = full_state(model, optimizer)
    resumed = []
    for load in ("ours", "distributed"):
        m, o = model_and_optimizer()
        m.load_state_dict(model_state, strict=False)  # the frozen bias is not in it
        # A loaded optimizer may keep the tensors it is given (as a dict fresh from torch.load).
        state = copy.deepcopy(optimizer_state)
        if load == "ours":
            load_optimizer_state(m, o, state)
        else:
            options = StateDictOptions(full_state_dict=True)
            set_optimizer_state_dict(m, o, optim_state_dict=state, options=options)
        assert o.state_dict()["state"][0]["step"] == 1
        step(m, o)
        resumed.append(m)
    ours, theirs = resumed
    for a, b in zip(ours.parameters(), theirs.parameters(), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("moe", [False, True])
def test_the_model_files_are_save_pretrained_s_byte_for_byte(moe: bool, tmp_path: Path) -> None:
    """The checkpoint writes the model with safetensors directly: the files are what
    `save_pretrained` writes (the tied lm_head dropped; the MoE experts, fused in memory, split
    back per expert as on the hub), and an unsharded model's `full_state` is the distributed
    helper's."""
    from safetensors import safe_open
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    from asyncrl.tiny_model import new_tiny_model, new_tiny_moe
    from asyncrl.trainer.checkpoint import TrainerState, save_checkpoint
    from asyncrl.trainer.parallel import full_state

    model = (new_tiny_moe if moe else new_tiny_model)(seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(input_ids=torch.tensor([[1, 5, 6]])).logits.sum().backward()
    optimizer.step()
    model_state, optimizer_state = full_state(model, optimizer)
    options = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=True)
    their_model, their_optimizer = get_state_dict(model, optimizer, options=options)
    assert set(their_model) - set(model_state) == {"lm_head.weight"}  # the tied alias
    assert all(torch.equal(v, their_model[k]) for k, v in model_state.items())
    assert optimizer_state["param_groups"] == their_optimizer["param_groups"]
    assert optimizer_state["state"].keys() == their_optimizer["state"].keys()
    for name, s in optimizer_state["state"].items():
        assert all(torch.equal(v, their_optimizer["state"][name][k]) for k, v in s.items())

    ours = save_checkpoint(
        tmp_path / "checkpoints",
        model,
        model_state,
        optimizer_state,
        TrainerState(step=1, version=1, cursor={}, wall_seconds=0.0),
        tokenizer_dir=None,
        keep=1,
    )
    theirs = tmp_path / "save_pretrained"
    model.save_pretrained(theirs, state_dict=dict(model_state), safe_serialization=True)
    for f in theirs.iterdir():
        assert (ours / f.name).read_bytes() == f.read_bytes(), f.name
    with safe_open(ours / "model.safetensors", "pt") as f:
        keys = set(f.keys())
    assert "lm_head.weight" not in keys
    assert any(".experts.0." in k for k in keys) == moe
