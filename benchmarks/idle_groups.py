"""What idle gloo process groups cost a training step: with 5 more groups per rank, against none.

    .venv/bin/python benchmarks/idle_groups.py [--blocks 30] [--steps 50] [--smoke]

A rank of the built-in trainer on CPUs holds gloo groups it rarely or never uses: DeviceMesh's axes of size 1
(tensor, pipeline, context parallel) and its node's group. Each gloo group has its own transport loop thread,
which wakes about every 10 ms even when idle. Two gloo ranks on this machine, one thread each, run "steps" of
matrix products (about 25 ms here); in every other block each rank holds 5 more groups of its own (made, then
destroyed after the block). The raw DeepSpeed loop of benchmarks/trainer_overhead.py makes no DeviceMesh, so
this is part of what the trainer pays against it, and torch's cost, not hpc_train's code.
"""

from __future__ import annotations

import statistics
import time

from hpc_train.bench.local_ranks import BlockSteps, join_gloo_pair, run_blocks

EXTRA_GROUPS = 5


def _rank(told: BlockSteps) -> None:
    import torch.distributed as dist

    rank, blocks, steps = told.rank, told.blocks, told.steps
    step = join_gloo_pair(told)
    times: dict[bool, list[float]] = {True: [], False: []}
    for block in range(2 * blocks):
        extra = block % 2 == 0
        groups = [group for _ in range(EXTRA_GROUPS if extra else 0)
                  for group in (dist.new_group([0]), dist.new_group([1]))]  # every rank makes each; one is its own
        dist.barrier()
        time.sleep(0.2)  # the groups' threads settled
        start = time.perf_counter()
        for _ in range(steps):
            step()
        times[extra].append((time.perf_counter() - start) / steps)
        dist.barrier()
        for group in groups:
            dist.destroy_process_group(group)
    if rank == 0:
        base, more = statistics.median(times[False]), statistics.median(times[True])
        print(f"{'groups per rank':<22} {'ms/step':>8} {'ratio':>7}")
        print(f"{'default only':<22} {base * 1e3:>8.2f} {1.0:>7.3f}")
        print(f"{f'{EXTRA_GROUPS} more, idle':<22} {more * 1e3:>8.2f} {more / base:>7.3f}")
    dist.destroy_process_group()


def main() -> None:
    run_blocks(__doc__ or "", __file__, _rank, blocks=30)


if __name__ == "__main__":
    main()
