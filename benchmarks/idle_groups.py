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

import argparse
import os
import statistics
import time

from hpc_train.bench.local_ranks import run_ranks
from hpc_train.bench.machine import machine

EXTRA_GROUPS = 5


def _rank(rank: int, port: int, blocks: int, steps: int) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    a, b = torch.randn(384, 384), torch.randn(384, 384)
    times: dict[bool, list[float]] = {True: [], False: []}
    for block in range(2 * blocks):
        extra = block % 2 == 0
        groups = [group for _ in range(EXTRA_GROUPS if extra else 0)
                  for group in (dist.new_group([0]), dist.new_group([1]))]  # every rank makes each; one is its own
        dist.barrier()
        time.sleep(0.2)  # the groups' threads settled
        start = time.perf_counter()
        for _ in range(steps):
            for _ in range(40):
                a @ b
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
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks", type=int, default=30, help="blocks of each kind")
    parser.add_argument("--steps", type=int, default=50, help="steps a block")
    parser.add_argument("--smoke", action="store_true", help="2 blocks of 5 steps")
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    blocks, steps = (2, 5) if args.smoke else (args.blocks, args.steps)
    if args.rank is not None:
        _rank(args.rank, args.port, blocks, steps)
        return
    print(machine().line(), flush=True)
    run_ranks(__file__, ["--blocks", str(blocks), "--steps", str(steps)])

if __name__ == "__main__":
    main()
