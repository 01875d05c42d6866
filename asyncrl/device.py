"""cpu | cuda | npu: the one table of what differs between the accelerators asyncrl runs on.

Everything per device kind lives here — the collective backend of a weight-sync group, the
environment variable that restricts a process to some devices, the `--device` flag of an SGLang
server — so that adding a kind is one table row — and the few operations whose code differs by
kind (resolving `auto`, waiting for queued work). The pure lookups import nothing heavy (config
validation and the launcher use them); the rest import torch, and `torch_npu` only for npu,
because importing torch_npu patches torch and it exists only on Ascend machines. Beside them,
the host side: `return_freed_memory`, how the trainer has glibc's allocator treat tensors.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
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


def kind_of(name: str) -> DeviceKind:
    """The kind of a device name such as "cuda" or "npu:1"; ValueError naming the allowed."""
    try:
        return KINDS[name.split(":", 1)[0]]
    except KeyError:
        raise ValueError(f"unknown device {name!r}; allowed: {', '.join(KINDS)}") from None


def backend_of(name: str) -> str:
    return kind_of(name).backend


def visible_devices_env(
    name: str, ids: Sequence[int], environ: Mapping[str, str] | None = None
) -> dict[str, str]:
    """Environment that shows a child process only devices `ids` (empty for cpu). The ids count
    within the devices this process sees: under Ray (or a user's own mask) the visible-devices
    variable `environ` (default: this process's) already names a subset, and a child's ids index
    into it rather than name physical devices."""
    kind = kind_of(name)
    if kind.visible_env is None:
        return {}
    inherited = (os.environ if environ is None else environ).get(kind.visible_env, "")
    visible = [d.strip() for d in inherited.split(",") if d.strip()]
    if not visible:
        return {kind.visible_env: ",".join(str(i) for i in ids)}
    if ids and max(ids) >= len(visible):
        raise ValueError(
            f"{kind.visible_env}={inherited} shows {len(visible)} device(s), but device "
            f"{max(ids)} (counting from 0) is asked for: fewer servers or devices per server"
        )
    return {kind.visible_env: ",".join(visible[i] for i in ids)}


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
    """The device a config's `device: auto|cpu|cuda|npu` names for this process: `auto` is cuda
    where torch sees one, else cpu; an accelerator's index is the launcher's LOCAL_RANK."""
    import torch

    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return torch_device(name, int(os.environ.get("LOCAL_RANK", 0)))


def synchronize(device: torch.device) -> None:
    """Block until the work queued on `device` is done (no-op on CPU)."""
    if device.type != "cpu":
        import torch

        torch.get_device_module(device).synchronize(device)


def copies_done(device: torch.device) -> torch.Event | None:
    """An event that completes once the work queued so far on `device`'s current stream has;
    None on CPU, where copies are done when they return."""
    if device.type == "cpu":
        return None
    import torch

    event = torch.Event(device=device)
    event.record()
    return event


# Host allocations at least this large get pages of their own, returned when freed.
_MMAP_THRESHOLD = 128 * 1024
_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter


def return_freed_memory() -> None:
    """Have glibc give freed tensors' memory back to the system. By default it serves any
    allocation under a threshold that grows to 32 MiB after the first large free from its heap,
    which it does not shrink: a step's activations and gradients then stay resident after the
    step (at 50 M parameters the steady peak was 1.55× parameters + gradients + Adam, against
    1.20× with this; bench_scale.py, docs/benchmarks.md). A fixed threshold also stops it from
    growing. Costs a page fault per page of each large allocation. No-op without glibc."""
    import ctypes

    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD)
    except (OSError, AttributeError):
        pass
