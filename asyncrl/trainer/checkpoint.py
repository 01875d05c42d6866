"""Atomic trainer checkpoints: a Hugging Face model directory plus optimizer, RNG and run state.

Layout: `{run_dir}/checkpoints/step_{step:08d}/` holds `config.json`, `model.safetensors`, the
tokenizer files (so the folder loads with `from_pretrained`), `optimizer.pt` (full tensors keyed
by parameter name, whatever `trainer.parallel` and the rank count were), `rng.pt` and
`trainer_state.json`. A checkpoint is written to `step_N.tmp`, every file fsynced, then renamed:
a folder without the `.tmp` suffix is complete. Only then may trajectory entries of its steps be
acked (DESIGN §9). A write that fails (a full disk) removes the `.tmp` folder and raises
`CheckpointError`; older checkpoints are deleted only after a newer one is complete. Beside
them, `published_version` holds the highest version the run has handed out (`record_version`).
With `model.lora` a checkpoint is a peft adapter directory instead (`adapter_config.json`,
`adapter_model.safetensors`, loaded over the base at `model.path`), and `optimizer.pt` holds the
adapter's state only.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError

from asyncrl.trainer.parallel import load_optimizer_state

_PREFIX = "step_"


@dataclass
class TrainerState:
    step: int
    """Optimizer steps done."""
    version: int
    """Policy version these weights were published as."""
    cursor: dict[str, int]
    """Data cursor (epoch, position, seed) of the prompts released up to this checkpoint."""
    wall_seconds: float
    """Training wall time accumulated over the run's lifetimes."""
    covered: dict[str, list[str]] = field(default_factory=dict)
    """Trajectory entry ids trained in the steps since the previous checkpoint, by the consumer
    (`trainer-{rank}`) that holds them. They are acked right after this checkpoint is durable; a
    trainer killed in between acks them at restart instead of training them again."""
    counters: dict[str, int] = field(default_factory=dict)
    """The run counters as last read before this checkpoint: what a trainer resumed from it
    compares Redis's with, to find a Redis that lost its data (`asyncrl.trainer.admission`)."""
    groups_consumed: int | None = None
    """Prompt groups the steps so far consumed (the sum of each step's `groups_per_step`), which
    the admission budget starts from; None in checkpoints older than it (then step × G)."""
    task: dict[str, Any] | None = None
    """The `task` config the data cursor walks (a resumed run must keep it); None in older
    checkpoints."""


class CheckpointError(Exception):
    """A checkpoint could not be written; the message is one line naming the folder and why."""


def _write_failure(tmp: Path, exc: Exception, previous: Path | None) -> str:
    """One line on a failed write. torch and safetensors hide the errno (`basic_ios::clear`,
    `unexpected pos`), so the free space is reported too: a full disk is the usual cause."""
    detail = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
    detail = detail.strip().splitlines()[0][:200] if detail.strip() else type(exc).__name__
    free = shutil.disk_usage(tmp.parent).free / 2**20
    kept = f"{previous} is intact" if previous else "there is no earlier checkpoint"
    return (
        f"could not write checkpoint {tmp} ({detail}): is the disk full (ENOSPC)? "
        f"{free:.1f} MiB free there; {kept}"
    )


def _fsync_tree(path: Path) -> None:
    for f in path.iterdir():
        if f.is_file():
            with f.open("rb") as fh:
                os.fsync(fh.fileno())
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_model(out: Path, model: Any, state: dict[str, Any]) -> None:
    """What `save_pretrained(out, state_dict=state)` writes, without its per-call machinery
    (quantizers, hub, offloading, TP and peft branches, a tqdm bar): the config, the generation
    config, and the weights named and shaped as on the hub — tied aliases dropped and the
    in-memory conversions (fused MoE experts) reverted by transformers' own functions — in
    `model.safetensors`, or in shards of at most 50 GB with their index, as `save_pretrained`
    splits them. A peft model keeps peft's writer: its adapter directory is small."""
    from transformers import PreTrainedModel

    if not isinstance(model, PreTrainedModel):
        model.save_pretrained(out, state_dict=state, safe_serialization=True)
        return
    from huggingface_hub import split_torch_state_dict_into_shards
    from safetensors.torch import save_file
    from transformers.core_model_loading import revert_weight_conversion
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    model.config.dtype = str(model.dtype).split(".")[1]
    model.config.architectures = [type(model).__name__.removeprefix("FSDP")]
    model.config.save_pretrained(out)
    if model.can_generate():
        model.generation_config.save_pretrained(out)
    state = {k: v for k, v in state.items() if k not in (model._keys_to_ignore_on_save or ())}
    state = revert_weight_conversion(model, remove_tied_weights_from_state_dict(state, model))
    split = split_torch_state_dict_into_shards(
        state, filename_pattern="model{suffix}.safetensors", max_shard_size="50GB"
    )
    for name, keys in split.filename_to_tensors.items():
        save_file({k: state[k].contiguous() for k in keys}, out / name, metadata={"format": "pt"})
    if split.is_sharded:
        meta = {"total_parameters": model.num_parameters(), **split.metadata}
        index = {"metadata": meta, "weight_map": split.tensor_to_filename}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def save_checkpoint(
    root: Path,
    model: Any,
    model_state: dict[str, Any],
    optimizer_state: dict[str, Any],
    state: TrainerState,
    *,
    tokenizer_dir: Path | None,
    keep: int,
) -> Path:
    """Write `model`'s config with the full `model_state` and `optimizer_state` (from
    `parallel.full_state`); rank 0 only. A peft model writes its adapter config and adapter."""
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"{_PREFIX}{state.step:08d}"
    tmp = root / f"{final.name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir()
        _write_model(tmp, model, model_state)
        if tokenizer_dir is not None:
            for f in tokenizer_dir.iterdir():
                if f.is_file() and ("token" in f.name or f.name == "special_tokens_map.json"):
                    shutil.copy2(f, tmp / f.name)
        torch.save(optimizer_state, tmp / "optimizer.pt")
        # The data order is derived from the cursor, not from RNG state, so torch's RNG is all
        # the randomness a resumed step needs (dropout, if a model has it).
        torch.save({"torch": torch.get_rng_state()}, tmp / "rng.pt")
        (tmp / "trainer_state.json").write_text(json.dumps(asdict(state)))
        _fsync_tree(tmp)
    except (OSError, RuntimeError, SafetensorError) as exc:
        shutil.rmtree(tmp, ignore_errors=True)  # frees what it took; never loaded either way
        previous = list_checkpoints(root)
        raise CheckpointError(_write_failure(tmp, exc, previous[-1] if previous else None)) from exc
    if final.exists():
        shutil.rmtree(final)
    tmp.rename(final)
    _fsync_tree(root)
    for old in list_checkpoints(root)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def list_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    if not root.is_dir():
        return []
    done = [p for p in root.iterdir() if p.name.startswith(_PREFIX) and not p.name.endswith(".tmp")]
    return sorted(done, key=lambda p: int(p.name.removeprefix(_PREFIX)))


def load_checkpoint(
    path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> TrainerState:
    """Restore optimizer and RNG from `path` (the caller loaded `model` from the same folder and
    placed it; every rank calls this) and return the run state."""
    load_optimizer_state(model, optimizer, torch.load(path / "optimizer.pt", weights_only=True))
    rng = torch.load(path / "rng.pt", weights_only=True)
    torch.set_rng_state(rng["torch"])
    return read_state(path)


def read_state(path: Path) -> TrainerState:
    """The run state of the checkpoint at `path`."""
    return TrainerState(**json.loads((path / "trainer_state.json").read_text()))


# What makes a model another one for a checkpoint's weights: its architecture and shapes.
_IDENTITY = ("model_type", "architectures", "vocab_size", "hidden_size", "num_hidden_layers")


def resume_refusal(path: Path, model_dir: Path, task: dict[str, Any]) -> str | None:
    """Why the run may not resume the checkpoint at `path` with the base model at `model_dir`
    and the `task` config, as one line naming the key; None when it may. The weights must fit
    the base (its tokenizer, reference and the workers' engines come from there), and the data
    cursor indexes the task's train split, which another task would make skip or repeat."""
    saved = path / "config.json"
    if saved.is_file():  # a LoRA checkpoint holds an adapter, checked against model.lora
        mine = json.loads(saved.read_text())
        base = json.loads((model_dir / "config.json").read_text())
        for key in _IDENTITY:
            if mine.get(key) != base.get(key):
                return (
                    f"model.path={model_dir}: {key} {base.get(key)!r} differs from the "
                    f"checkpoint's {mine.get(key)!r} ({path}); resume with the run's own model "
                    "or start a new run.dir"
                )
    held = read_state(path).task
    if held is not None and held != task:
        key = next(k for k in sorted({*held, *task}) if held.get(k) != task.get(k))
        return (
            f"task.{key}: {task.get(key)!r} differs from the checkpoint's {held.get(key)!r} "
            f"({path}): the data cursor walks the run's own task; resume with it or start a "
            "new run.dir"
        )
    return None


_VERSION_FILE = "published_version"


def record_version(root: Path, version: int) -> None:
    """Note in the checkpoint folder `root`, before it goes out, the highest version this run has
    published. The
    `version` key in Redis says the same, but a Redis may come back without its data, and a
    checkpoint knows only the versions before it: with this record a trainer that restarts after
    both never hands out a number twice. Rename keeps the file whole; no fsync: losing the last
    write takes a crash of the machine, which takes the unsynced steps with it."""
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f"{_VERSION_FILE}.tmp"
    tmp.write_text(f"{version}\n")
    os.replace(tmp, root / _VERSION_FILE)


def recorded_version(root: Path) -> int:
    """The version `record_version` last noted in `root`; -1 if none (or unreadable)."""
    try:
        return int((root / _VERSION_FILE).read_text())
    except (OSError, ValueError):
        return -1
