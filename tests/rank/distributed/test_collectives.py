"""The device helpers every collective goes through: numbers in, numbers out, on real gloo ranks; and the
device they pick for each backend (NCCL: the current GPU)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from hpc_train.rank.distributed import collectives
from tests.rank.distributed.multiproc import run_workers


def _every_helper(rank: int, world: int) -> dict[str, Any]:
    from hpc_train.rank.distributed.collectives import (
        PendingReduce,
        all_gather_objects,
        all_gather_values,
        all_reduce_values,
        barrier,
        broadcast_object,
        gather_objects,
        group_device,
    )

    pending = PendingReduce([rank, 10 - rank], "max")
    result = {
        "device": str(group_device()),
        "sum": all_reduce_values([rank, 1.5]), "min": all_reduce_values([rank + 3], "min", dtype=torch.int64),
        "gathered": all_gather_values([rank * 2.0, -rank]), "object": broadcast_object({"from": rank}),
        "objects": all_gather_objects(f"r{rank}"), "at_0": gather_objects(rank * 10),
    }
    barrier()
    result["pending"] = pending.wait()
    return result


def test_the_helpers_on_real_ranks() -> None:
    first, second = run_workers(_every_helper, 2, timeout_s=120)
    assert first["device"] == second["device"] == "cpu"
    assert first["sum"] == second["sum"] == [1.0, 3.0] and first["min"] == [3]
    assert first["gathered"] == [[0.0, 0.0], [2.0, -1.0]] and first["object"] == second["object"] == {"from": 0}
    assert first["objects"] == ["r0", "r1"] and first["at_0"] == [0, 10] and second["at_0"] is None
    assert first["pending"] == second["pending"] == [1, 10]


def test_nccl_moves_the_current_gpu_and_everything_else_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert collectives.device_for_backend("nccl") == torch.device("cuda", 3)
    assert collectives.device_for_backend("gloo") == torch.device("cpu")
    assert collectives.device_for_backend("mpi") == torch.device("cpu")
