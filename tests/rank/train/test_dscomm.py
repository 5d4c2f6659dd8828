"""DeepSpeed's communication layer starts on our group without its shared-memory all-reduce: nothing is
compiled for it (40 s on a fresh installation) and no buffer is left in /dev/shm (66 MB per rank per run)."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest

from hpc_train.rank.train.dscomm import SHM_BUFFER_PREFIX
from tests.rank.distributed.multiproc import run_workers

pytestmark = pytest.mark.slow
SHM = Path("/dev/shm")


def _start(rank: int, world: int) -> dict[str, Any]:
    os.environ.update(LOCAL_RANK=str(rank), LOCAL_SIZE=str(world))  # LOCAL_SIZE = world: DeepSpeed would map
    import deepspeed
    import torch
    import torch.distributed as dist

    from hpc_train.rank.train.dscomm import init_deepspeed_comm

    started = time.monotonic()
    init_deepspeed_comm(rank)
    seconds = time.monotonic() - started
    total = torch.ones(1)
    deepspeed.comm.inference_all_reduce(total)  # the op's one user: it falls back to the process group
    dist.barrier()
    return {"local_size": os.environ.get("LOCAL_SIZE"), "initialized": deepspeed.comm.is_initialized(),
            "shm_op": deepspeed.comm.comm.cdb.shm_comm_op is not None, "seconds": seconds, "sum": total.item()}


@pytest.mark.skipif(not SHM.is_dir(), reason="no /dev/shm on this system")
def test_no_shared_memory_op_is_built_and_no_buffer_is_left() -> None:
    before = set(SHM.glob(f"{SHM_BUFFER_PREFIX}_*"))
    results = run_workers(_start, 2, timeout_s=240)
    assert set(SHM.glob(f"{SHM_BUFFER_PREFIX}_*")) == before
    assert all(r["initialized"] and r["local_size"] == "2" and not r["shm_op"] for r in results)
    assert all(r["sum"] == 2.0 for r in results)
    assert all(r["seconds"] < 20 for r in results), results  # nothing compiled (a build takes ~40 s)
