"""Which model a run trains: a fingerprint the trainer publishes and a rollout worker compares
with its own before it takes prompts.

A worker started with another model (a one-layer copy, another vocabulary) could never take a
weight sync: it would generate at version 0 forever, and its groups would take prompts and
budget from healthy workers until they turned stale. The fingerprint is of the model, not of an
engine: tensor names and shapes from the safetensors headers of `model.path` (no weight is read;
dtypes are left out, so a bf16 engine matches an fp32 trainer, and an SGLang worker, which holds
no tensors, is checked the same way), the vocabulary size, and the LoRA settings that shape the
adapter an adapter-only sync carries.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import redis

    from asyncrl.model_config import LoraConfig
    from asyncrl.runstate import Keys


class ModelMismatch(Exception):
    """This worker's model is not the run's: one line, naming `model.path`."""


@dataclass(frozen=True)
class ModelIdentity:
    digest: str
    """sha256 of the tensor names and shapes, the vocabulary size and the LoRA shape."""
    tensors: int
    parameters: int
    vocab: int

    def describe(self) -> str:
        return f"{self.tensors} tensors, {self.parameters:,} parameters, vocabulary {self.vocab}"

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, raw: bytes | str) -> ModelIdentity:
        """Raises ValueError for anything but a record `to_json` wrote."""
        try:
            record = json.loads(raw)
            identity = cls(**record)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"not a model identity: {exc}") from None
        if not all(isinstance(v, int) for v in (identity.tensors, identity.parameters)):
            raise ValueError("not a model identity: counts are not integers")
        return identity


def model_identity(path: Path, lora: LoraConfig | None) -> ModelIdentity:
    from safetensors import safe_open

    from asyncrl.model import vocab_size

    shapes: dict[str, list[int]] = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(file, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is no mapping)
                shapes[name] = list(f.get_slice(name).get_shape())
    vocab = vocab_size(path)
    adapter = None if lora is None else [lora.rank, lora.target_modules, lora.trainable_modules]
    shape = json.dumps([sorted(shapes.items()), vocab, adapter], separators=(",", ":"))
    return ModelIdentity(
        digest=hashlib.sha256(shape.encode()).hexdigest(),
        tensors=len(shapes),
        parameters=sum(math.prod(s) for s in shapes.values()),
        vocab=vocab,
    )


def publish_identity(client: redis.Redis, keys: Keys, identity: ModelIdentity) -> None:
    """The trainer's, written before it releases any prompt."""
    client.set(keys.model, identity.to_json())


def check_identity(client: redis.Redis, keys: Keys, ours: ModelIdentity, path: Path) -> bool:
    """True when the run's identity is published and is `ours`; False when none is published
    yet (no trainer has started: whatever prompts there are, no trainer released them).

    Raises ModelMismatch when it differs or cannot be read."""
    raw = client.get(keys.model)
    if raw is None:
        return False
    try:
        theirs = ModelIdentity.from_json(raw)
    except ValueError as exc:
        raise ModelMismatch(f"model identity of run {keys.run_id} in Redis: {exc}") from None
    if theirs.digest != ours.digest:
        raise ModelMismatch(
            f"model.path={path} is not the model run {keys.run_id} trains "
            f"({ours.describe()} here, {theirs.describe()} in the trainer's, or another "
            "model.lora); not joining"
        )
    return True
