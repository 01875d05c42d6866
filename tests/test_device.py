"""Device kinds: backend, visible-devices variable and SGLang flag per kind (pure logic)."""

import pytest
import torch

from asyncrl.device import (
    backend_of,
    kind_of,
    sglang_device_args,
    torch_device,
    visible_devices_env,
)
from asyncrl.weights.groups import resolve_backend


@pytest.mark.parametrize(
    ("name", "backend", "env", "flag"),
    [
        ("cpu", "gloo", {}, ["--device", "cpu"]),
        ("cuda", "nccl", {"CUDA_VISIBLE_DEVICES": "2,3"}, ["--device", "cuda"]),
        ("npu", "hccl", {"ASCEND_RT_VISIBLE_DEVICES": "2,3"}, ["--device", "npu"]),
        ("npu:1", "hccl", {"ASCEND_RT_VISIBLE_DEVICES": "2,3"}, ["--device", "npu"]),
    ],
)
def test_kind_tables(name: str, backend: str, env: dict[str, str], flag: list[str]) -> None:
    assert backend_of(name) == backend
    assert visible_devices_env(name, [2, 3], environ={}) == env
    assert sglang_device_args(name) == flag


def test_child_devices_index_into_the_ones_this_process_sees() -> None:
    # Ray gave this actor physical GPUs 4-7: server 1 of two devices each gets 6 and 7.
    ray_mask = {"CUDA_VISIBLE_DEVICES": "4,5,6,7"}
    assert visible_devices_env("cuda", [2, 3], ray_mask) == {"CUDA_VISIBLE_DEVICES": "6,7"}
    with pytest.raises(ValueError, match="shows 4 device"):
        visible_devices_env("cuda", [4], ray_mask)
    assert visible_devices_env("cpu", [0], ray_mask) == {}


def test_weight_sync_backend_comes_from_the_same_table() -> None:
    # torch knows the "npu" device type only once torch_npu is imported (not here).
    for name in ("cpu", "cuda"):
        assert resolve_backend("auto", torch.device(name)) == backend_of(name)
    assert resolve_backend("gloo", torch.device("cuda")) == "gloo"  # explicit wins


def test_unknown_device_names_the_allowed() -> None:
    with pytest.raises(ValueError, match="allowed: cpu, cuda, npu"):
        kind_of("tpu")


def test_torch_device_without_accelerator_imports() -> None:
    assert torch_device("cpu") == torch.device("cpu")
    # cuda needs no runtime to name a device; npu would import torch_npu, absent here.
    assert torch_device("cuda:1") == torch.device("cuda", 1)
    assert torch_device("cuda", 2) == torch.device("cuda", 2)
    assert kind_of("npu").visible_env == "ASCEND_RT_VISIBLE_DEVICES"


def test_resolve_device_takes_the_local_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    from asyncrl.device import resolve_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert resolve_device("auto") == torch.device("cpu")
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("cuda") == torch.device("cuda", 1)
