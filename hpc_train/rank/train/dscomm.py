"""DeepSpeed's communication layer, started on the process group our bootstrap already made.

DeepSpeed's CPU backend brings a shared-memory all-reduce that only inference all-reduce uses, which training
never calls (and which falls back to the process group without it). It costs twice. On its first start it is
compiled (about 40 s on two cores, for every new installation, and every later job waits on the lock of a
build that was killed). And when ``LOCAL_SIZE`` equals the world size it maps a 66 MB buffer per rank in
``/dev/shm`` (``deepspeed_allreduce_buffer_*``) and never unlinks it: every CPU run on one machine leaked 130 MB
or more of RAM until ``/dev/shm`` filled memory. So the op is marked incompatible before the backend starts,
which leaves nothing to compile and nothing to map, and ``LOCAL_SIZE`` is hidden while it starts as well. The
ops a job's optimizer needs (``cpu_adam``, ``fused_adam``) are built by :mod:`hpc_train.rank.train.jit_ops` once
per node.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["SHM_BUFFER_PREFIX", "init_deepspeed_comm"]

SHM_BUFFER_PREFIX = "deepspeed_allreduce_buffer"


@contextmanager
def _local_size_hidden() -> Iterator[None]:
    saved = os.environ.pop("LOCAL_SIZE", None)
    try:
        yield
    finally:
        if saved is not None:
            os.environ["LOCAL_SIZE"] = saved


def _without_shm_all_reduce() -> None:
    """DeepSpeed's CPU backend compiles its shm all-reduce op on first start (about 40 s on two cores) and maps
    its buffers; only inference all-reduce uses it, which falls back to the process group without it."""
    import deepspeed.ops
    from deepspeed.accelerator import get_accelerator

    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    if builder is not None:
        deepspeed.ops.__compatible_ops__[builder.NAME] = False


def init_deepspeed_comm(local_rank: int | None = None, ops: tuple[str, ...] = ()) -> None:
    """Adopt the initialised torch.distributed group as DeepSpeed's (idempotent): the ``ops`` the job's optimizer
    needs built first, and no shm all-reduce (nothing to compile on CPU, no buffers)."""
    import deepspeed
    import torch.distributed as dist

    from hpc_train.rank.distributed.collectives import barrier
    from hpc_train.rank.train.jit_ops import prepare_for_initialize

    if deepspeed.comm.is_initialized():
        return
    _without_shm_all_reduce()
    prepare_for_initialize(local_rank, barrier, ops)
    with _local_size_hidden():
        deepspeed.init_distributed(dist_backend=dist.get_backend(), auto_mpi_discovery=False)
