"""How a weight-sync group is made and released: its backend, rendezvous store and members.

The backend of `weights.backend: auto` comes from the device table (`asyncrl.device`: cpu → gloo,
cuda → nccl, npu → hccl). `torch_npu` is imported here and only on the hccl path: importing it
patches torch, and it exists only on Ascend machines.

Groups are built directly on a store with an explicit rank, size and timeout — never through
`init_process_group` — so they live beside the trainer's default group and never touch it. With
nccl, the watchdog's reaction to a timed-out op follows `TORCH_NCCL_ASYNC_ERROR_HANDLING`; its
default (3) ends the process, so a trainer that must outlive a hung subscriber runs with 2
(abort the communicator, raise, keep the process).
"""

from __future__ import annotations

import socket
from datetime import timedelta
from typing import Protocol, cast

import torch
import torch.distributed as dist

from asyncrl.device import KINDS


class Group(Protocol):
    """What weight sync uses of a c10d backend object (the type stubs give `Backend` no
    collectives, though every backend has them)."""

    def broadcast(self, tensors: list[torch.Tensor], opts: dist.BroadcastOptions) -> dist.Work: ...

    def abort(self) -> None: ...

    def shutdown(self) -> None: ...


def resolve_backend(requested: str, device: torch.device) -> str:
    if requested != "auto":
        return requested
    try:
        return KINDS[device.type].backend
    except KeyError:
        raise ValueError(
            f"weights.backend=auto knows no backend for device type {device.type!r}; "
            "set weights.backend to gloo, nccl or hccl"
        ) from None


def comm_device(backend: str, device: torch.device) -> torch.device:
    """Where the flat buffers live: host memory for gloo, the accelerator for nccl and hccl."""
    return torch.device("cpu") if backend == "gloo" else device


def master_store(addr: str, port: int, timeout: timedelta) -> dist.TCPStore:
    """The rendezvous TCPStore server, listening on `addr` only.

    A TCPStore server on its own listens on every interface; it has no authentication, so the
    socket is bound here (to `weights.master_addr`, loopback by default) and handed over.
    """
    try:
        sock = socket.create_server((addr, port), backlog=1024)
    except OSError as exc:
        raise ValueError(
            f"weights.master_addr={addr!r}, weights.master_port={port}: cannot listen there "
            f"({exc.strerror or exc}); give an address of this host"
        ) from None
    bound_port = sock.getsockname()[1]
    # The store owns (and closes) the descriptor from here on.
    return dist.TCPStore(
        addr,
        bound_port,
        is_master=True,
        wait_for_workers=False,
        timeout=timeout,
        use_libuv=True,
        master_listen_fd=sock.detach(),
    )


def local_addr_towards(host: str, port: int) -> str:
    """This host's address on the route to `host` (no packet is sent): where a gloo peer of a
    group rooted there should listen — loopback when the publisher is local."""
    family, _, _, _, sockaddr = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect(sockaddr)
        return str(probe.getsockname()[0])


def new_group(
    backend: str,
    store: dist.Store,
    rank: int,
    size: int,
    timeout: timedelta,
    device: torch.device,
    listen_addr: str,
) -> Group:
    """A process group over `store` (give each group its own PrefixStore) for weight sync only.

    gloo peers listen on `listen_addr` rather than on the address their host name resolves to,
    so that a single-host run exposes nothing beyond loopback; nccl and hccl choose their
    interfaces themselves (`NCCL_SOCKET_IFNAME`, `HCCL_IF_IP`).
    """
    if backend == "gloo":
        opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # not in the stubs
        opts._timeout = timeout
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=listen_addr)]
        return cast(Group, dist.ProcessGroupGloo(store, rank, size, opts))
    if backend == "nccl":
        from torch._C._distributed_c10d import ProcessGroupNCCL

        torch.cuda.set_device(device)
        nccl_opts = ProcessGroupNCCL.Options()
        nccl_opts._timeout = timeout
        return cast(Group, ProcessGroupNCCL(store, rank, size, nccl_opts))
    if backend == "hccl":
        import torch_npu

        torch_npu.npu.set_device(device)
        hccl = torch_npu._C._distributed_c10d.ProcessGroupHCCL
        hccl_opts = hccl.Options()
        hccl_opts._timeout = timeout
        return cast(Group, hccl(store, rank, size, hccl_opts))
    raise ValueError(f"weights.backend={backend!r} is not one of gloo, nccl, hccl")


def release_group(group: Group, *, broken: bool) -> None:
    """Free a group's communicators: abort a broken one (its pending ops will never complete),
    shut a healthy one down. Either way its peers' next op on it fails instead of hanging."""
    if broken:
        group.abort()
    else:
        group.shutdown()


def join_update_group(
    backend: str,
    store: dist.Store,
    rank: int,
    world_size: int,
    group_name: str,
    timeout: timedelta,
) -> dist.ProcessGroup:
    """Join the weight-update group `group_name` over `store`, as SGLang's servers do.

    The servers build their end with `_new_process_group_helper` on `PrefixStore(group_name,
    store)`, which adds per-group and per-device prefixes of its own and (for gloo) one backend
    per device type; only the same call here produces the same store keys and the same set of
    backends. No default group is needed: an empty rank list makes the helper treat the group as
    standalone. A trainer whose default group is bound to a device would have the helper split
    this group off it, which cannot work with outside members, hence the refusal.
    """
    from torch.distributed.distributed_c10d import (
        GroupName,
        _get_default_group,
        _new_process_group_helper,
        _world,
    )

    if dist.is_initialized() and _get_default_group().bound_device_id is not None:
        raise RuntimeError(
            "the default process group is bound to a device (init_process_group(device_id=...)); "
            "SGLang weight-update groups cannot be created beside it"
        )
    if backend == "hccl":
        import torch_npu  # noqa: F401  # registers the hccl backend with torch.distributed

    pg, _ = _new_process_group_helper(
        world_size,
        rank,
        [],
        backend,
        dist.PrefixStore(group_name, store),
        group_name=GroupName(group_name),
        timeout=timeout,
    )
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def post_broadcasts(
    group: Group | dist.ProcessGroup, tensors: list[torch.Tensor]
) -> list[dist.Work]:
    """Start a broadcast from rank 0 of each tensor, in order; all in flight at once."""
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    return [group.broadcast([t], opts) for t in tensors]


def broadcast_all(group: Group | dist.ProcessGroup, tensors: list[torch.Tensor]) -> None:
    """Broadcast each tensor from rank 0 of `group`, in order, all in flight at once."""
    for work in post_broadcasts(group, tensors):
        work.wait()
