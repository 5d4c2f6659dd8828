"""What the preemption flag's all-reduce costs a step: after every step, against hpc_train's rounds, against none.

    .venv/bin/python benchmarks/flag_rounds.py [--blocks 16] [--steps 50] [--smoke]

Two gloo ranks on this machine, one thread each, run "steps" of matrix products (about 25 ms here). In each block
of steps a rank either starts an all-reduce of the flag after every step and reads it after the next (the trainer
before its rounds), or calls ``FlagRounds.tick`` after every step (the trainer now: a round about every
``STEP_ROUND_S``), or does nothing (the baseline). Blocks alternate; the figure is the median step time of each.
"""

from __future__ import annotations

import statistics
import time

from hpc_train.bench.local_ranks import BlockSteps, join_gloo_pair, run_blocks

MODES = ("none", "every step", "rounds")


def _rank(told: BlockSteps) -> None:
    import torch.distributed as dist

    from hpc_train.rank.distributed.collectives import PendingReduce
    from hpc_train.rank.runtime.preemption import MAX_STEPS_PER_ROUND, STEP_ROUND_S, FlagRounds

    rank, blocks, steps = told.rank, told.blocks, told.steps
    step = join_gloo_pair(told)
    times: dict[str, list[float]] = {mode: [] for mode in MODES}
    for block in range(blocks * len(MODES)):
        mode = MODES[block % len(MODES)]
        rounds, pending = FlagRounds(STEP_ROUND_S, MAX_STEPS_PER_ROUND), None
        dist.barrier()
        start = time.perf_counter()
        for _ in range(steps):
            step()
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
    run_blocks(__doc__ or "", __file__, _rank, blocks=16)


if __name__ == "__main__":
    main()
