"""What the benchmarks that run jobs on the local Slurm cluster share: a job's state, a run folder's JSON lines, a
rank's pid, a wait that cancels the job when it gives up. Imported by the scripts beside it (run as
``python benchmarks/NAME.py``, this folder is on their path)."""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from hpc_train.run.watch import slurm_job_processes, slurm_rank_pid

__all__ = ["rank_pid", "records", "slurm_job_processes", "state", "wait"]


def state(job_id: str) -> str:
    out = subprocess.run(["sacct", "-n", "-P", "-X", "-j", job_id, "-o", "State"], capture_output=True, text=True,
                         timeout=30, check=False).stdout.split()
    return out[-1] if out else ""


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def rank_pid(job_id: str, rank: int) -> int:
    """The pid of rank ``rank`` of job ``job_id``; the script ends when none runs."""
    pid = slurm_rank_pid(job_id, rank)
    if pid is None:
        raise SystemExit(f"no rank {rank} of job {job_id} runs")
    return pid


def wait(what: str, done: Callable[[], bool], job_id: str, run_dir: Path, timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        if time.monotonic() > deadline or state(job_id) in ("FAILED", "CANCELLED", "TIMEOUT"):
            subprocess.run(["scancel", job_id], check=False, timeout=30)
            raise SystemExit(f"job {job_id}: no {what} ({state(job_id)}); see {run_dir}/logs")
        time.sleep(0.2)
