"""``hpc_train.Executor.submit(fn).result()`` against submitit's ``AutoExecutor.submit(fn).results()[0]`` (a job
of several tasks has one result each) on the local Slurm cluster, 2 nodes x 1 task, in one run.

    scripts/local_slurm.sh up && .venv/bin/python benchmarks/api_vs_submitit.py [--runs 5] [--smoke]

Both submit the same function from this Python process and wait for its result. Under submitit the function
does what a submitit user's distributed function does first (``TorchDistributedEnvironment().export()``, import
torch, join a gloo group); under hpc_train the rank has done that before it calls the function. The function
writes the time of its first line to a file, so each path gives the seconds to the function's first line and to
the result in this process. The runs alternate, the paths meet the scheduler's one-second tick alike. Figures:
min, median and max over the runs, and the ratios of the medians (hpc_train / submitit).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import cloudpickle

import hpc_train

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the nodes cannot import this script


def under_hpc_train(out: str) -> int:
    with open(out, "a") as handle:  # the function's first line
        handle.write(f"{time.time()}\n")
    return hpc_train.context().world_size


def under_submitit(out: str) -> int:
    import submitit

    environment = submitit.helpers.TorchDistributedEnvironment().export()
    import torch.distributed as dist

    dist.init_process_group("gloo")
    if environment.rank == 0:
        with open(out, "a") as handle:
            handle.write(f"{time.time()}\n")
    world = dist.get_world_size()
    dist.destroy_process_group()
    return world


def _first_line(path: Path) -> float:
    return min(float(line) for line in path.read_text().split())


def _one(kind: str, folder: Path) -> tuple[float, float]:
    """(seconds to the function's first line, seconds to the result) of one submission."""
    out = folder / f"{kind}-{time.monotonic_ns()}.txt"
    start = time.time()
    if kind == "hpc_train":
        job: Any = hpc_train.Executor(site="local-slurm", nodes=2, tasks_per_node=1, cpus_per_task=1,
                                      time="00:10:00").submit(under_hpc_train, str(out))
    else:
        import submitit

        executor = submitit.AutoExecutor(folder=folder / "submitit")
        executor.update_parameters(nodes=2, tasks_per_node=1, cpus_per_task=1, timeout_min=10)
        job = executor.submit(under_submitit, str(out))
    value = job.result() if kind == "hpc_train" else job.results()[0]  # submitit: one result per task
    assert value == 2, value
    return _first_line(out) - start, time.time() - start


def _summary(values: list[float]) -> str:
    return f"min {min(values):.2f} s, median {statistics.median(values):.2f} s, max {max(values):.2f} s"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--smoke", action="store_true", help="one run of each (tests/benchmarks/test_smoke.py)")
    args = parser.parse_args()
    if args.smoke:
        args.runs = 1
    print(f"CPU: {platform.processor() or platform.machine()}, {os.cpu_count()} cores; load average "
          f"{os.getloadavg()[0]:.2f}; python {platform.python_version()}")
    figures: dict[str, list[tuple[float, float]]] = {"hpc_train": [], "submitit": []}
    with tempfile.TemporaryDirectory(prefix="api-bench-") as tmp:  # the nodes of the local cluster see /tmp
        os.chdir(tmp)  # run folders go under ./runs
        for index in range(args.runs):
            for kind in (("hpc_train", "submitit") if index % 2 == 0 else ("submitit", "hpc_train")):
                figures[kind].append(_one(kind, Path(tmp)))
    for kind, pairs in figures.items():
        print(f"{kind:9}  first line: {_summary([p[0] for p in pairs])};  result: {_summary([p[1] for p in pairs])}")
    ratio = [statistics.median(p[i] for p in figures["hpc_train"]) / statistics.median(p[i] for p in
                                                                                      figures["submitit"])
             for i in (0, 1)]
    print(f"ratio hpc_train / submitit (medians): first line {ratio[0]:.2f}, result {ratio[1]:.2f} "
          f"({args.runs} runs each, alternating)")


if __name__ == "__main__":
    main()
