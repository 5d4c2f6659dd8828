"""What the preemption flag's all-reduce costs a step: after every step, against hpc_train's rounds, against none.

    .venv/bin/python benchmarks/flag_rounds.py [--blocks 16] [--steps 50] [--smoke]

Two gloo ranks on this machine, one thread each, run "steps" of matrix products (about 25 ms here). In each block
of steps a rank either starts an all-reduce of the flag after every step and reads it after the next (the trainer
before its rounds), or calls ``FlagRounds.tick`` after every step (the trainer now: a round about every
``STEP_ROUND_S``), or does nothing (the baseline). Blocks alternate; the figure is the median step time of each.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from hpc_train.bench.local_ranks import run_ranks
from hpc_train.bench.machine import machine

MODES = ("none", "every step", "rounds")


def _rank(rank: int, port: int, blocks: int, steps: int) -> None:
    import torch
    import torch.distributed as dist

    from hpc_train.rank.distributed.collectives import PendingReduce
    from hpc_train.rank.runtime.preemption import MAX_STEPS_PER_ROUND, STEP_ROUND_S, FlagRounds

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    a, b = torch.randn(384, 384), torch.randn(384, 384)
    times: dict[str, list[float]] = {mode: [] for mode in MODES}
    for block in range(blocks * len(MODES)):
        mode = MODES[block % len(MODES)]
        rounds, pending = FlagRounds(STEP_ROUND_S, MAX_STEPS_PER_ROUND), None
        dist.barrier()
        start = time.perf_counter()
        for _ in range(steps):
            for _ in range(40):
                a @ b
            if mode == "every step":
                if pending is not None:
                    pending.wait()
                pending = PendingReduce([0], "max")
            elif mode == "rounds":
                rounds.tick(0)
        if pending is not None:
            pending.wait()
        rounds.finish()
        times[mode].append((time.perf_counter() - start) / steps)
    if rank == 0:
        base = statistics.median(times["none"])
        print(f"{'flag all-reduce':<16} {'ms/step':>8} {'ratio':>7}")
        for mode in MODES:
            median = statistics.median(times[mode])
            print(f"{mode:<16} {median * 1e3:>8.2f} {median / base:>7.3f}")
        print(f"rounds: about every {STEP_ROUND_S} s of steps, at most every {MAX_STEPS_PER_ROUND} steps")
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks", type=int, default=16, help="blocks of each mode")
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
