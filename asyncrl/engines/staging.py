"""Weights staged for an in-process engine (`InProcessWeights`): handed over on the weight
subscriber's thread, swapped into the model only where no forward runs — at once when the
engine is idle, else between two decode steps of the running `generate`."""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping

import torch

from asyncrl.lora import synced
from asyncrl.metrics.breakdown import phase
from asyncrl.weights.base import Released


class StagedWeights:
    """The model's weights by version: what is loaded, and the newer version staged, if any."""

    def __init__(
        self, model: torch.nn.Module, version: int, on_swap: Callable[[int], None] | None
    ) -> None:
        """`on_swap(version)` runs after each swap, under the lock (the prefix cache drops what
        older weights computed)."""
        # Every name a state dict may use, tied aliases included; updates must cover what trains
        # (all parameters, or a LoRA model's adapter).
        self._targets: dict[str, torch.Tensor] = dict(model.state_dict(keep_vars=True))
        self._required = {name for name, _ in synced(model)}
        self._on_swap = on_swap
        self._lock = threading.Lock()  # guards everything below
        self._version = version
        self._pending: tuple[int, Mapping[str, torch.Tensor]] | None = None
        self._busy = False

    @property
    def version(self) -> int:
        return self._version

    def stage(self, tensors: Mapping[str, torch.Tensor], version: int) -> None:
        """`InProcessWeights.stage_weights`."""
        missing = self._required - tensors.keys()
        unknown = tensors.keys() - self._targets.keys()
        if missing or unknown:
            raise ValueError(
                f"weights for version {version}: missing {sorted(missing)[:5]}, "
                f"unknown {sorted(unknown)[:5]}"
            )
        for name, tensor in tensors.items():
            if tensor.shape != self._targets[name].shape:
                raise ValueError(
                    f"weights for version {version}: {name} has shape {tuple(tensor.shape)}, "
                    f"expected {tuple(self._targets[name].shape)}"
                )
        with self._lock:
            newest = self._pending[0] if self._pending is not None else self._version
            if version <= newest:
                raise ValueError(f"version {version} is not newer than {newest}")
            self._pending = (version, tensors)
            if not self._busy:
                self._apply_pending()

    def relabel(self, version: int) -> None:
        """`TorchEngine.relabel`."""
        with self._lock:
            if self._pending is not None or version < self._version:
                raise ValueError(f"version {version}: the engine holds or stages a newer one")
            self._version = version

    def set_busy(self, busy: bool) -> None:
        """While busy, staged weights wait for `current()`; going idle applies them."""
        with self._lock:
            self._busy = busy
            if not busy:
                self._apply_pending()

    def current(self) -> int:
        """Swap in the staged weights, if any (between two steps); the version loaded now."""
        with self._lock:
            self._apply_pending()
            return self._version

    def _apply_pending(self) -> None:
        """Copy staged weights into the model; caller holds `_lock`."""
        if self._pending is None:
            return
        version, tensors = self._pending
        keep = isinstance(tensors, Released)
        # Charged on the generating thread only: a swap while idle is the subscriber's time.
        with torch.no_grad(), phase("weight_swap"):
            for name, tensor in tensors.items():
                target = self._targets[name]
                if keep and (tensor.dtype, tensor.device) == (target.dtype, target.device):
                    target.data = tensor  # tied aliases share the parameter, so they follow
                else:
                    target.copy_(tensor)
        self._version = version
        self._pending = None
        if self._on_swap is not None:
            self._on_swap(version)
