"""Whether fresh processes compute the same step on this CPU, with several threads against one.

    .venv/bin/python benchmarks/cpu_determinism.py [--processes 12] [--threads 4] [--cbwr] [--smoke]

A restart is bitwise equal to the uninterrupted run only if a new process computes what the old one did. Each
process here builds the tiny GPT (seed 1234), runs one forward and backward on a fixed batch, and prints a digest
of the loss and every gradient, and the median time of 10 more steps. The processes start one after another
while busy loops hold every CPU (as a standby rank's start meets the running ranks). The baseline is the same
with one thread. ``--cbwr`` adds a row with MKL's conditional numerical reproducibility (``MKL_CBWR=COMPATIBLE``).
Found here: with 2 or 4 threads, MKL inside torch's CPU build now and then computes one thread's share of
``torch.exp`` to about 13 bits for a whole process (docs/preemption.md, "Bitwise on CPUs").
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import subprocess
import sys

from hpc_train.bench.machine import machine

CHILD = """
import hashlib, statistics, sys, time
import torch, torch.distributed as dist
torch.set_num_threads(int(sys.argv[1]))
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
from hpc_train.common.topology import Topology
from hpc_train.rank.distributed.mesh import ParallelGroups
from hpc_train.rank.train.model import GPT, GPTConfig
groups = ParallelGroups(Topology.build(1, tp=1, pp=1, cp=1, order="tp-cp-dp-pp"), "cpu")
model = GPT(GPTConfig.from_preset("tiny", 256, 64), groups.group("tp"), seed=1234)
tokens = torch.randint(0, 256, (8, 65), generator=torch.Generator().manual_seed(0))
loss = model(tokens[:, :-1], tokens[:, 1:])
loss.backward()
digest = hashlib.sha256(loss.detach().numpy().tobytes())
for parameter in model.parameters():
    digest.update(parameter.grad.numpy().tobytes())
times = []
for _ in range(int(sys.argv[2])):  # the step's time, after the digest
    start = time.perf_counter()
    model(tokens[:, :-1], tokens[:, 1:]).backward()
    times.append(time.perf_counter() - start)
print(statistics.median(times) if times else 0.0, digest.hexdigest()[:16])
dist.destroy_process_group()
"""


def _digest(threads: int, env: dict[str, str], timed_steps: int) -> tuple[str, float]:
    """One process's digest of its first step, and the median time of ``timed_steps`` more."""
    done = subprocess.run([sys.executable, "-c", CHILD, str(threads), str(timed_steps)], capture_output=True,
                          text=True, timeout=300, env=env, check=True)
    seconds, digest = done.stdout.split()[-2:]
    return digest, float(seconds)


def _busy(count: int) -> list[subprocess.Popen[bytes]]:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--processes", type=int, default=12)
    parser.add_argument("--threads", type=int, default=4)
    parser.add_argument("--cbwr", action="store_true", help="a row with MKL_CBWR=COMPATIBLE too")
    parser.add_argument("--smoke", action="store_true", help="2 processes a row, 2 threads, no busy loop (CI)")
    args = parser.parse_args()
    processes, threads, busy_loops = (2, 2, 0) if args.smoke else (args.processes, args.threads, os.cpu_count() or 1)
    rows = [(f"{threads}", threads, {}), ("1", 1, {})]
    if args.cbwr:
        rows.insert(1, (f"{threads}, MKL_CBWR=COMPATIBLE", threads, {"MKL_CBWR": "COMPATIBLE"}))
    print(machine().line())
    found: dict[str, list[str]] = {name: [] for name, _, _ in rows}
    step_s: dict[str, list[float]] = {name: [] for name, _, _ in rows}
    busy = _busy(busy_loops)
    try:
        for _ in range(processes):  # the rows alternate, so a change in load meets each of them
            for name, count, extra in rows:
                digest, seconds = _digest(count, {**os.environ, **extra}, 1 if args.smoke else 10)
                found[name].append(digest)
                step_s[name].append(seconds)
    finally:
        for loop in busy:
            loop.kill()
            loop.wait()
    print(f"{'threads':<28} {'processes':>9} {'distinct results':>16} {'off the majority':>16} {'ms/step':>8}")
    for name, digests in found.items():
        counts = collections.Counter(digests)
        off = len(digests) - counts.most_common(1)[0][1]
        print(f"{name:<28} {len(digests):>9} {len(counts):>16} {off:>16} "
              f"{statistics.median(step_s[name]) * 1e3:>8.1f}")
    print("results (first 8 hex digits of each distinct digest, with its count): " + "; ".join(
        f"{name}: " + ", ".join(f"{d[:8]} x{c}" for d, c in collections.Counter(found[name]).most_common())
        for name in found))


if __name__ == "__main__":
    main()
