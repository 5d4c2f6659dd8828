"""The distributed smoke program: every rank joins one process group and all-reduces its rank.

It proves the whole path (plan, launcher, rendezvous, process group) before any model is involved, and it
is what a submitted job runs until the trainer exists.
"""

from __future__ import annotations

import os
import socket
from datetime import timedelta
from typing import Any

from hpc_train.dist.faults import maybe_inject_fault
from hpc_train.dist.ranks import RankInfo

__all__ = ["run_smoke"]


def run_smoke(info: RankInfo, timeout_s: float = 120.0) -> dict[str, Any]:
    """All-reduce the ranks and all-gather host names; raise if the sum is not 0 + 1 + ... + (world - 1)."""
    import torch
    import torch.distributed as dist

    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(info.local_rank)
    dist.init_process_group(backend, rank=info.rank, world_size=info.world_size,
                            init_method=f"tcp://{info.master_addr}:{info.master_port}",
                            timeout=timedelta(seconds=timeout_s))
    # No try/finally: on an error the process group is left to process exit, so that the failing rank reports
    # before its peers notice it is gone (the follower names the first rank to fail as the cause).
    maybe_inject_fault(info.rank)
    device = torch.device("cuda", info.local_rank) if backend == "nccl" else torch.device("cpu")
    value = torch.tensor([float(info.rank)], device=device)
    dist.all_reduce(value)
    expected = info.world_size * (info.world_size - 1) / 2
    hosts: list[Any] = [None] * info.world_size
    # Slurm's node name tells nodes apart even where several share one host (the local test cluster).
    dist.all_gather_object(hosts, os.environ.get("SLURMD_NODENAME") or socket.gethostname())
    if value.item() != expected:
        raise RuntimeError(f"all_reduce of ranks gave {value.item()}, expected {expected}")
    dist.destroy_process_group()
    return {"rank": info.rank, "world_size": info.world_size, "backend": backend, "all_reduce": value.item(),
            "expected": expected, "hosts": hosts, "launcher": info.launcher}
