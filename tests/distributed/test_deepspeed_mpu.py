"""The model-parallel unit in DeepSpeed itself: 4 real ranks, tensor 2 x data 2, ZeRO-1, one optimizer step.

DeepSpeed must take our groups: its data-parallel world is 2 (not 4), its model-parallel world 2, and after a
step both data-parallel replicas of each tensor shard hold the same weights.
"""

from __future__ import annotations

import os
from typing import Any

import pytest

from tests.distributed.multiproc import run_workers

pytestmark = pytest.mark.slow


def _deepspeed_step(rank: int, world_size: int) -> dict[str, Any]:
    # No LOCAL_SIZE: with it DeepSpeed maps (and leaks) a 66 MB /dev/shm buffer per rank (hpc_train.train.dscomm).
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size))
    import deepspeed
    import torch
    import torch.distributed as dist

    from hpc_train.distributed.mesh import ModelParallelUnit, ParallelGroups
    from hpc_train.distributed.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from hpc_train.distributed.topology import Topology

    groups = ParallelGroups(Topology.build(world_size, tp=2))
    tp_group = groups.group("tp")
    model = torch.nn.Sequential(ColumnParallelLinear(8, 16, tp_group, seed=1),
                                torch.nn.GELU(), RowParallelLinear(16, 8, tp_group, seed=2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
              "zero_optimization": {"stage": 1}, "steps_per_print": 1000}
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config,
                                      mpu=ModelParallelUnit(groups))
    torch.manual_seed(100 + groups.coord("dp"))  # each data-parallel replica sees its own batch
    batch = torch.randn(2, 8)
    before = model[0].weight.detach().clone()
    loss = engine(batch).pow(2).mean()
    engine.backward(loss)
    engine.step()
    weight = model[0].weight.detach().clone()
    replicas = [torch.zeros_like(weight) for _ in range(world_size)]
    dist.all_gather(replicas, weight)
    same_as_replica = bool(torch.equal(replicas[rank], replicas[groups.topology.group_of(rank, "dp")[0]]))
    return {"dp_world": engine.dp_world_size, "mp_world": engine.mp_world_size,
            "dp_ranks": dist.get_process_group_ranks(engine.data_parallel_group),
            "loss": float(loss), "same_as_replica": same_as_replica, "changed": not torch.equal(before, weight)}


def test_deepspeed_takes_our_groups() -> None:
    results = run_workers(_deepspeed_step, 4, timeout_s=240)
    for rank, result in enumerate(results):
        assert result["dp_world"] == 2 and result["mp_world"] == 2
        assert result["dp_ranks"] == [rank % 2, rank % 2 + 2]
        assert result["same_as_replica"] and result["changed"]
    assert results[0]["loss"] != results[2]["loss"]  # the replicas really saw different data
