"""Process start to first all-reduce on 4 local ranks: hpc_train's bootstrap against a bare init_process_group.

    .venv/bin/python benchmarks/bootstrap.py [--runs 8] [--smoke]

Both start 4 fresh interpreters that import torch, join one gloo group on 127.0.0.1 and all-reduce once; the
figure is the slowest rank's time from the parent's Popen to the end of that all-reduce. hpc_train's path adds
launcher detection, the rendezvous checks and its own TCPStore.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

from hpc_train.bench.local_ranks import free_port

RANK_PROGRAM = """
import os, sys, time
start = float(sys.argv[1])
import torch, torch.distributed as dist
if sys.argv[2] == "hpc_train":
    from hpc_train.rank.distributed.bootstrap import bootstrap
    bootstrap()
else:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{os.environ['MASTER_PORT']}",
                            rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
value = torch.ones(1)
dist.all_reduce(value)
print(time.time() - start)
dist.destroy_process_group()
"""


def run(path: str, world: int = 4) -> float:
    port = free_port()
    start = time.time()
    procs = []
    for rank in range(world):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
               "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "OMP_NUM_THREADS": "1"}
        procs.append(subprocess.Popen([sys.executable, "-c", RANK_PROGRAM, str(start), path], env=env,
                                      stdout=subprocess.PIPE, text=True))
    times = [float(proc.communicate(timeout=120)[0].split()[-1]) for proc in procs]
    return max(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=8)
    parser.add_argument("--smoke", action="store_true", help="one run of 2 ranks each, no warm-up: the benchmark "
                        "runs end to end in seconds (CI), its figures mean nothing")
    args = parser.parse_args()
    world, warmups = (2, 0) if args.smoke else (4, 1)
    if args.smoke:
        args.runs = 1
    results: dict[str, list[float]] = {"hpc_train bootstrap": [], "bare init_process_group": []}
    for _ in range(warmups):
        run("bare", world)  # warm-up: page cache
    for index in range(args.runs):
        order = list(results) if index % 2 == 0 else list(reversed(results))
        for name in order:
            results[name].append(run("hpc_train" if name.startswith("hpc") else "bare", world))
    base = statistics.median(results["bare init_process_group"])
    print(f"{args.runs} runs, {world} ranks on this machine: median (min-max) seconds to the first all-reduce")
    for name, times in results.items():
        median = statistics.median(times)
        print(f"{name:26} {median:6.2f} ({min(times):.2f}-{max(times):.2f}) {median / base:6.2f}x")


if __name__ == "__main__":
    main()
