"""Watching a run from outside while it runs: the last step it logged, and the process of one local rank.

The end-to-end tests and the benchmarks both drive a real run and act at a step (send a signal to one rank,
time the save). They share these readers here, beside the layout they read, because a benchmark must not
import the tests; the package itself never needs them.
"""

from __future__ import annotations

import json
from pathlib import Path

from hpc_train.run.paths import METRICS_FILE, SUBMITIT_DIR
from hpc_train.run.procs import Process, command_line, environment, processes

__all__ = ["last_logged_step", "local_rank_pid", "slurm_job_processes", "slurm_rank_pid"]


def last_logged_step(run_dir: Path) -> int:
    """The highest step in rank 0's ``metrics.jsonl`` (0 before the first record); a line rank 0 is still
    writing is skipped."""
    try:
        lines = (Path(run_dir) / METRICS_FILE).read_text(encoding="utf-8").splitlines()
    except OSError:
        return 0
    steps = []
    for line in lines:
        try:
            record = json.loads(line)
        except (ValueError, RecursionError):
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), int):
            steps.append(record["step"])
    return max(steps, default=0)


def local_rank_pid(run_dir: Path, rank: int) -> int | None:
    """The pid of the live rank ``rank`` of this run under submitit's local executor (its tasks run
    ``submitit.core._submit`` on the run's ``submitit/`` folder and carry their rank in the environment).

    A rank's forked children (data loader workers) carry the same command line and environment, and those of an
    attempt that just ended outlive it for a few seconds: the rank is the newest such process whose parent is
    not one of them (a signal sent to an old attempt's worker is lost)."""
    marker = str(Path(run_dir) / SUBMITIT_DIR).encode()
    found: dict[int, Process] = {}
    for process in processes():
        cmdline = command_line(process.pid) or b""
        if not process.alive or b"submitit.core._submit" not in cmdline or marker not in cmdline:
            continue
        env = environment(process.pid) or {}
        if env.get(b"SUBMITIT_LOCAL_GLOBALID") == str(rank).encode():
            found[process.pid] = process
    ranks = [pid for pid, process in found.items() if process.parent not in found]
    return max(ranks, key=lambda pid: found[pid].start, default=None)


def slurm_rank_pid(job_id: str, rank: int) -> int | None:
    """The pid of the live rank ``rank`` of Slurm job ``job_id`` on this machine (every node of the local cluster is
    this machine): a ``hpc_train.launch`` process whose environment carries the job and the rank."""
    for process in processes():
        env = environment(process.pid) or {}
        if env.get(b"SLURM_JOB_ID") == job_id.encode() and env.get(b"SLURM_PROCID") == str(rank).encode() \
                and b"hpc_train.launch" in (command_line(process.pid) or b"") and process.alive:
            return process.pid
    return None


def slurm_job_processes(job_id: str, node: str) -> list[int]:
    """Every process of Slurm job ``job_id`` on local-cluster node ``node`` (its agent, its ranks, their workers):
    those whose environment says so."""
    found = []
    for process in processes():
        env = environment(process.pid) or {}
        if env.get(b"SLURM_JOB_ID") == job_id.encode() and env.get(b"SLURMD_NODENAME") == node.encode():
            found.append(process.pid)
    return found
