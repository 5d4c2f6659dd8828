"""Exposed communication: on two real gloo ranks the clock counts the time a rank waits inside collectives (a sync
call, an async handle's wait, a nested call once) only while a step's phases run, and an injected slow collective
shows on both ranks; on a GPU the profiled step's NCCL kernels count where no other kernel overlaps them."""

from __future__ import annotations

import json
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from hpc_train.rank.train.breakdown import StepBreakdown
from hpc_train.rank.train.comm_clock import CollectiveClock, exposed_seconds
from tests.rank.train.gloo_ranks import two_gloo_ranks


def _rank(rank: int, store: str, out: str) -> None:
    dist.init_process_group("gloo", store=dist.FileStore(store, 2), rank=rank, world_size=2,
                            timeout=timedelta(seconds=60))
    before = dist.all_reduce
    clock = CollectiveClock.install(delay_s=0.0)
    assert dist.all_reduce is not before
    figures: dict[str, float] = {}
    tensor = torch.ones(4)
    dist.all_reduce(tensor)  # outside a phase: not counted
    figures["inactive"] = clock.take()
    timing = StepBreakdown(torch.device("cpu"), clock=clock)
    with timing.phase("backward"):
        if rank == 1:
            time.sleep(0.2)  # rank 0 waits for it inside the collective
        dist.all_reduce(tensor)
    figures["sync"] = clock.take()
    with timing.phase("backward"):
        work = dist.all_reduce(tensor, async_op=True)
        if rank == 1:
            time.sleep(0.2)
        dist.barrier()  # rank 0 waits here for rank 1's sleep
        work.wait()
    figures["async"] = clock.take()
    with timing.phase("optimizer"):
        gathered: list[object] = [None, None]
        if rank == 1:
            time.sleep(0.2)
        dist.all_gather_object(gathered, rank)  # calls all_gather inside: counted once
    figures["nested"] = clock.take()
    clock.delay_s = 0.1 if rank == 1 else 0.0  # HPC_TRAIN_INJECT_FAULT=slow_comm:1:100
    began = time.perf_counter()
    with timing.phase("backward"):
        dist.all_reduce(tensor)
    timing.step_done(time.perf_counter() - began)
    record = timing.collect()
    figures.update({key: value for key, value in record.items() if key.startswith("comm")})
    figures["value"] = float(tensor[0])
    clock.uninstall()
    figures["restored"] = float(dist.all_reduce is before)
    Path(out).write_text(json.dumps(figures))
    dist.destroy_process_group()


def test_two_ranks_count_their_waits_inside_collectives(tmp_path: Path) -> None:
    first, second = two_gloo_ranks(_rank, tmp_path)
    assert first["inactive"] == second["inactive"] == 0.0
    assert 0.18 < first["sync"] < 1.0 and second["sync"] < 0.1  # the waiting rank, not the late one
    assert 0.18 < first["async"] < 1.0
    assert 0.18 < first["nested"] < 0.35 and second["nested"] < 0.1  # the inner all_gather waits are not added
    # the injected delay: rank 1 spends it inside the collective and rank 0 waits for it there
    assert first["comm_ms"] > 90 and second["comm_ms"] > 90
    assert first["comm_ms_min"] == second["comm_ms_min"] and first["comm_ms_max"] == second["comm_ms_max"]
    assert first["comm_share"] > 0.9
    assert first["value"] == 2.0**4 and first["restored"] == 1.0


def test_the_exposed_part_is_what_no_compute_covers() -> None:
    assert exposed_seconds([(0, 10)], []) == 10
    assert exposed_seconds([(0, 10)], [(2, 4), (3, 6), (8, 20)]) == 4  # 0-2 and 6-8
    assert exposed_seconds([(0, 5), (4, 8), (20, 30)], [(25, 40)]) == 13  # merged 0-8, then 20-25
    assert exposed_seconds([(5, 6)], [(0, 10)]) == 0


def test_a_gpu_rank_leaves_the_host_clock_off() -> None:
    clock = CollectiveClock()
    timing = StepBreakdown(torch.device("cuda", 0), clock=clock)
    assert timing.clock is None  # NCCL launches return at once: the device timeline is sampled instead
    cpu = StepBreakdown(torch.device("cpu"), clock=clock)
    with cpu.phase("forward"):
        assert clock.active
    assert not clock.active


@pytest.mark.parametrize("logged", [False, True])
def test_sampling_is_a_gpu_matter(logged: bool) -> None:
    timing = StepBreakdown(torch.device("cpu"), clock=None, sample_every=1)
    with timing.sampled(logged):
        pass
    assert "comm_ms" not in timing.collect()  # no clock, no GPU: nothing measured, nothing reported
