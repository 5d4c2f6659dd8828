"""Submit-to-first-output on the local Slurm cluster: hpc_train.submit against a hand-written sbatch script.

    scripts/local_slurm.sh up && .venv/bin/python benchmarks/submit_latency.py [--runs 7] [--smoke]

Both run the same work on 2 nodes x 2 ranks (start, import torch, join one gloo group, all-reduce) and write
rank 0's first line to a file. The clock starts before the submitting command and stops when that line
appears, and again when the job's last line appears. hpc_train.submit runs as users run it, following the job.
Slurm starts queued jobs on a tick of about a second, so each run waits a random part of a second first (the
same sequence for both paths) and the runs alternate: both paths meet every phase of the tick alike.
Target: ratio <= 1.2.
"""

from __future__ import annotations

import argparse
import functools
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from hpc_train.run.node_log import rank_log_text

RANK_PROGRAM = """
import os, sys, time
rank = int(os.environ["SLURM_PROCID"])
out = open(sys.argv[1] + f"/rank-{rank}.log", "a", buffering=1)
out.write(f"{time.time()} rank {rank} start\\n")
import torch, torch.distributed as dist
dist.init_process_group("gloo", rank=rank, world_size=int(os.environ["SLURM_NTASKS"]),
                        init_method=f"tcp://{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}")
value = torch.tensor([float(rank)])
dist.all_reduce(value)
dist.destroy_process_group()
out.write(f"{time.time()} rank {rank} smoke: all_reduce {value.item()}\\n")
"""
BASELINE = """#!/bin/bash
#SBATCH --nodes=2
#SBATCH --ntasks-per-node={tasks_per_node}
#SBATCH --cpus-per-task=2
#SBATCH --output={out}/slurm-%j.out
export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | sed -n 1p)
export MASTER_PORT=$(( 20000 + SLURM_JOB_ID % 40000 ))
srun {python} -u {program} {out}
"""
JOB = '[job]\nname = "latency"\nprogram = "smoke"\nnodes = 2\ntasks_per_node = {tasks_per_node}\ntime = "00:10:00"\n'


def _wait_for_line(read: Callable[[], str], needle: str, start: float, where: str, timeout: float = 120) -> float:
    """Seconds from ``start`` until ``needle`` is in the text ``read`` returns (polled every 10 ms)."""
    while time.perf_counter() - start < timeout:
        try:
            if needle in read():
                return time.perf_counter() - start
        except FileNotFoundError:
            pass
        time.sleep(0.01)
    raise TimeoutError(f"no {needle!r} in {where} after {timeout} s")


def _idle(jitter: float) -> None:
    """Wait until no job is queued, so every run starts on an idle cluster, then a random phase."""
    while subprocess.run(["squeue", "-h"], capture_output=True, text=True, check=True).stdout.strip():
        time.sleep(0.2)
    time.sleep(0.5 + jitter)


def run_hpc_train(work: Path, index: int, tasks_per_node: int) -> tuple[float, float]:
    folder = work / f"h{index}"
    folder.mkdir()
    (folder / "job.toml").write_text(JOB.format(tasks_per_node=tasks_per_node))
    start = time.perf_counter()
    command = subprocess.Popen([sys.executable, "-m", "hpc_train.submit", "job.toml", "--site", "local-slurm"],
                               cwd=folder, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    run_dir = folder / "runs" / "latency"
    rank0 = functools.partial(rank_log_text, run_dir, 0)  # rank 0's lines of its node's log
    first = _wait_for_line(rank0, "start:", start, f"rank 0's log in {run_dir}")
    done = _wait_for_line(rank0, "smoke:", start, f"rank 0's log in {run_dir}")
    if command.wait(timeout=120) != 0:
        raise RuntimeError(f"hpc_train.submit failed in {folder}")
    return first, done


def run_baseline(work: Path, index: int, tasks_per_node: int) -> tuple[float, float]:
    folder = work / f"b{index}"
    folder.mkdir()
    (folder / "rank.py").write_text(RANK_PROGRAM)
    script = folder / "job.sbatch"
    script.write_text(BASELINE.format(out=folder, python=sys.executable, program=folder / "rank.py",
                                      tasks_per_node=tasks_per_node))
    start = time.perf_counter()
    subprocess.run(["sbatch", str(script)], cwd=folder, capture_output=True, check=True)
    log = folder / "rank-0.log"  # the hand-written program's own file, one per rank
    first = _wait_for_line(log.read_text, "start", start, str(log))
    return first, _wait_for_line(log.read_text, "smoke:", start, str(log))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=12)
    parser.add_argument("--smoke", action="store_true", help="one run of 2 nodes x 1 rank each, no warm-up: the "
                        "benchmark runs end to end in seconds (CI), its figures mean nothing")
    args = parser.parse_args()
    tasks_per_node, warmups = (1, 0) if args.smoke else (2, 1)
    if args.smoke:
        args.runs = 1
    results: dict[str, list[tuple[float, float]]] = {"hpc_train.submit": [], "hand-written sbatch": []}
    phases = random.Random(0)  # noqa: S311 - benchmark phases, not secrets
    with tempfile.TemporaryDirectory(prefix="hpc_train-submit-latency-") as tmp:
        work = Path(tmp)
        _idle(0.0)
        for index in range(warmups):
            run_baseline(work, 99 - index, tasks_per_node)  # warm-up: page cache, torch import
        for index in range(args.runs):
            jitter = phases.random()
            order = [("hpc_train.submit", run_hpc_train), ("hand-written sbatch", run_baseline)]
            for name, runner in order if index % 2 == 0 else order[::-1]:
                _idle(jitter)
                results[name].append(runner(work, index, tasks_per_node))
    # Means, not medians: start times are quantised by Slurm's one-second tick, and with the phase spread
    # evenly the mean is the expected wait a user sees; medians of quantised samples jump by whole ticks.
    base = results["hand-written sbatch"]
    base_first, base_done = statistics.mean(t[0] for t in base), statistics.mean(t[1] for t in base)
    print(f"{args.runs} runs each, 2 nodes x {tasks_per_node} ranks: mean (median, min-max) seconds")
    print(f"{'path':22} {'first line':>26} {'ratio':>6} {'all-reduce done':>26} {'ratio':>6}")
    for name, times in results.items():
        cells = []
        for values, reference in (([t[0] for t in times], base_first), ([t[1] for t in times], base_done)):
            mean = statistics.mean(values)
            cells.append(f"{mean:5.2f} ({statistics.median(values):.2f}, {min(values):.2f}-{max(values):.2f})"
                         f" {mean / reference:6.2f}")
        print(f"{name:22} {cells[0]:>33} {cells[1]:>33}")


if __name__ == "__main__":
    main()
