"""DeepSpeed's communication layer, started on the process group our bootstrap already made.

Two things of DeepSpeed's CPU backend are kept in check here. It compiles an op on first use
(:mod:`hpc_train.train.jit_ops` builds it once per node). And when ``LOCAL_SIZE`` equals the world size it maps a
66 MB shared-memory all-reduce buffer per rank in ``/dev/shm`` (``deepspeed_allreduce_buffer_*``), used only by
inference all-reduce, which training never calls, and never unlinks it: every CPU run on one machine leaked
130 MB or more of RAM until ``/dev/shm`` filled memory. ``LOCAL_SIZE`` is hidden while the backend starts.
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


def init_deepspeed_comm(local_rank: int | None = None) -> None:
    """Adopt the initialised torch.distributed group as DeepSpeed's (idempotent); ops built first, no shm buffers."""
    import deepspeed
    import torch.distributed as dist

    from hpc_train.distributed.collectives import barrier
    from hpc_train.train.jit_ops import prepare_for_initialize

    if deepspeed.comm.is_initialized():
        return
    prepare_for_initialize(local_rank, barrier)
    with _local_size_hidden():
        deepspeed.init_distributed(dist_backend=dist.get_backend(), auto_mpi_discovery=False)
