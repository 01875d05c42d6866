"""The model directory a run trains: checking it, building the offline quickstart model when it is
absent, and reading its limits. Its config is `asyncrl.model_config`."""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from asyncrl.config import Config


def is_complete(path: Path) -> bool:
    return (path / "config.json").is_file() and any(path.glob("*.safetensors"))


def missing_model(cfg: Config) -> str | None:
    """Why `model.path` cannot serve this run (one line naming the key), or None when it holds a
    model or `model.build_tiny` will make one. Launch checks it before it touches Redis."""
    path = Path(cfg.model.path)
    if cfg.model.build_tiny or is_complete(path):
        return None
    return f"model.path={path} holds no Hugging Face model (config.json + weights)"


def ensure_model(cfg: Config, *, wait_s: float = 0.0) -> Path:
    """The model directory, built first when configured to; a rollout worker passes `wait_s` to
    wait for a trainer that is building it instead of building it twice."""
    path = Path(cfg.model.path)
    deadline = time.monotonic() + wait_s
    while not is_complete(path) and time.monotonic() < deadline:
        time.sleep(1.0)
    if is_complete(path):
        return path
    if (problem := missing_model(cfg)) is not None:
        raise SystemExit(problem)
    from asyncrl.tiny_model import build_tiny_model

    digits = getattr(cfg.task, "digits", 2)
    build_tiny_model(path, digits=digits, seed=cfg.run.seed, moe=cfg.model.tiny_moe)
    return path


def max_positions(path: Path) -> int | None:
    """Positions the model at `path` was built for (`max_position_embeddings`): no sequence
    runs, nor trains, past them (`protocol.Limits`); None where its config names none."""
    from transformers import AutoConfig

    limit = getattr(
        AutoConfig.from_pretrained(path).get_text_config(), "max_position_embeddings", None
    )
    return None if limit is None else int(limit)


def vocab_size(path: Path) -> int:
    """Token ids the model at `path` can embed are those below this: an id at or past it would
    index past the embedding (and the logits), so readers reject it (`protocol.Limits`)."""
    from transformers import AutoConfig

    return int(AutoConfig.from_pretrained(path).get_text_config().vocab_size)
