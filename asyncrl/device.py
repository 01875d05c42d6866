"""cpu | cuda | npu: the one table of what differs between the accelerators asyncrl runs on.

Everything per device kind lives here — the collective backend of a weight-sync group, the
environment variable that restricts a process to some devices, the `--device` flag of an SGLang
server — so that adding a kind is one table row. The pure lookups import nothing heavy (config
validation and the launcher use them); `torch_device` imports torch, and `torch_npu` only for
npu, because importing torch_npu patches torch and it exists only on Ascend machines.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    import torch

DeviceName = Literal["cpu", "cuda", "npu"]


@dataclass(frozen=True)
class DeviceKind:
    name: DeviceName
    backend: str
    """Collective backend of a torch.distributed group whose tensors live on this kind."""
    visible_env: str | None
    """Variable that limits which devices a child process sees; None where there is none."""
    sglang_device: str
    """Value of `python -m sglang.launch_server --device`."""


KINDS: dict[str, DeviceKind] = {
    "cpu": DeviceKind("cpu", "gloo", None, "cpu"),
    "cuda": DeviceKind("cuda", "nccl", "CUDA_VISIBLE_DEVICES", "cuda"),
    "npu": DeviceKind("npu", "hccl", "ASCEND_RT_VISIBLE_DEVICES", "npu"),
}

BACKEND_OF_DEVICE = {name: kind.backend for name, kind in KINDS.items()}
"""Device type → collective backend (cpu → gloo, cuda → nccl, npu → hccl)."""


def kind_of(name: str) -> DeviceKind:
    """The kind of a device name such as "cuda" or "npu:1"; ValueError naming the allowed."""
    try:
        return KINDS[name.split(":", 1)[0]]
    except KeyError:
        raise ValueError(f"unknown device {name!r}; allowed: {', '.join(KINDS)}") from None


def backend_of(name: str) -> str:
    return kind_of(name).backend


def visible_devices_env(name: str, ids: Sequence[int]) -> dict[str, str]:
    """Environment that shows a child process only devices `ids` (empty for cpu)."""
    kind = kind_of(name)
    if kind.visible_env is None:
        return {}
    return {kind.visible_env: ",".join(str(i) for i in ids)}


def sglang_device_args(name: str) -> list[str]:
    """The `--device` flag an SGLang server needs to run on this kind."""
    return ["--device", kind_of(name).sglang_device]


def torch_device(name: str, index: int | None = None) -> torch.device:
    """A torch.device of this kind; `index` defaults to the one in `name` (e.g. "npu:1")."""
    kind = kind_of(name)
    if index is None and ":" in name:
        index = int(name.split(":", 1)[1])
    import torch

    if kind.name == "npu":
        import torch_npu  # noqa: F401  # registers the "npu" device type with torch

    if kind.name == "cpu":
        return torch.device("cpu")
    return torch.device(kind.name, index if index is not None else 0)


def resolve_device(name: str) -> torch.device:
    """The device of a `trainer.device` / engine device setting: `auto` is this process' cuda
    device (LOCAL_RANK) when there is one, else the cpu; any other name than cuda or npu is the
    cpu."""
    import os

    import torch

    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        name = "cpu"
    if name == "cuda":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    if name == "npu":
        import torch_npu  # noqa: F401  # registers the npu device

        return torch.device("npu", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")
