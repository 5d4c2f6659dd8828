"""Bring one rank into the job: detect the launcher, agree on the rendezvous, start the process group.

Rank 0 opens the rendezvous store itself, so a taken port is an immediate, named error instead of a hang; the
other ranks connect to it within the init timeout, or fail naming the address they could not reach. The
process group (NCCL with CUDA, gloo without) then gets the collective timeout of the config.
"""

from __future__ import annotations

import contextlib
import os
import socket
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from hpc_train.rank.distributed.launchers import LaunchInfo, detect_launch
from hpc_train.rank.distributed.rendezvous import (
    Rendezvous,
    RendezvousError,
    check_resolves,
    choose_rendezvous,
    export_rendezvous,
)

__all__ = ["DistContext", "abort_nccl", "bootstrap", "shutdown"]


@dataclass(frozen=True)
class DistContext:
    """What a rank knows once the process group is up."""

    info: LaunchInfo
    rendezvous: Rendezvous
    backend: str


def _store(info: LaunchInfo, rendezvous: Rendezvous, timeout: timedelta) -> Any:
    import torch.distributed as dist

    is_master = info.rank == 0
    try:
        return dist.TCPStore(rendezvous.addr if not is_master else "0.0.0.0", rendezvous.port,  # noqa: S104
                             info.world_size, is_master, timeout=timeout, wait_for_workers=False)
    except (RuntimeError, OSError) as error:
        text = str(error)
        if is_master:
            raise RendezvousError(f"rank 0 on {socket.gethostname()} cannot listen on port {rendezvous.port} "
                                  f"({text.splitlines()[0] if text else error!r}): is another job using it? The port "
                                  "comes from the job id and the site's launch.port_range") from None
        raise RendezvousError(f"rank {info.rank} on {socket.gethostname()} could not reach rank 0 at "
                              f"{rendezvous.addr}:{rendezvous.port} within {timeout.total_seconds():.0f} s "
                              f"({text.splitlines()[0] if text else error!r}): check that rank 0 started, the "
                              "site's network.fabric_suffix and socket_ifname, and firewalls") from None


def bootstrap(info: LaunchInfo | None = None, expected_world: int | None = None,
              port_range: tuple[int, int] = (20000, 32768), fabric_suffix: str = "", init_timeout_s: float = 300,
              timeout_s: float = 1800) -> DistContext:
    """Detect (unless ``info`` is given), agree on the rendezvous, export RANK/WORLD_SIZE/LOCAL_RANK/
    MASTER_ADDR/MASTER_PORT/LOCAL_SIZE, and init the process group."""
    import torch
    import torch.distributed as dist

    info = info or detect_launch(expected_world=expected_world)
    rendezvous = choose_rendezvous(info, port_range, fabric_suffix)
    check_resolves(rendezvous.addr)
    export_rendezvous(info, rendezvous)
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(info.local_rank)
    timeout = timedelta(seconds=timeout_s)
    if info.kind.agent_store and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        dist.init_process_group(backend, init_method="env://", timeout=timeout)  # the agent hosts the store
    else:
        store = _store(info, rendezvous, timedelta(seconds=init_timeout_s))
        dist.init_process_group(backend, store=store, rank=info.rank, world_size=info.world_size, timeout=timeout)
    return DistContext(info, rendezvous, backend)


def shutdown() -> None:
    """Leave the process group if one is up."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def abort_nccl() -> None:
    """After a failure: abort every NCCL communicator of this process's groups in place, so that nothing waits on
    a dead peer any more (a destroy could wait on a collective that never completes), while the groups stay
    registered for what still asks for them (DeepSpeed's teardown asks for this rank). Nothing on other backends:
    gloo's groups end with :func:`shutdown` and their last reference. The aborts are one NCCL group call, as torch's
    own ``_abort_process_group`` makes them: one at a time, two communicators' aborts can wait on each other
    (pytorch#119797); torch's call would also unregister the groups."""
    import torch
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    if not dist.is_initialized() or dist.get_backend() != "nccl":
        return
    world: Any = None
    with contextlib.suppress(Exception):
        world = distributed_c10d._get_default_group()._get_backend(torch.device("cuda"))
    grouped = callable(getattr(world, "_group_start", None)) and callable(getattr(world, "_group_end", None))
    if grouped:
        world._group_start()
    try:
        for group in list(distributed_c10d._world.pg_map):
            for device in group._device_types:
                with contextlib.suppress(Exception):  # one that is gone already: the others still get theirs
                    group._get_backend(device).abort()
    finally:
        if grouped:
            world._group_end()
