"""The cluster section of benchmarks/control_plane.py: what a real 2-node Slurm job of the local cluster asks of
its run folder, every process of the job traced with strace (tests/strace_ops.py): in steady training, in a
window with checkpoint saves, and in a window with a restart in place (a rank killed); then the files the run
folder holds per node (2 nodes of 2 ranks: what is per rank shows as 2 a node), and what one checkpoint holds.
Needs the local cluster (scripts/local_slurm.sh up) and root for strace.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from hpc_train.run.procs import command_line, environment, processes
from hpc_train.run.watch import last_logged_step
from tests.strace_ops import descendants, trace_folder_ops

REPO = Path(__file__).resolve().parent.parent
NODES = 2
TASKS = 2  # per node
COMMON = ["--site", "local-slurm", "--set", f"job.nodes={NODES}", "--set", f"job.tasks_per_node={TASKS}", "--set",
          "train.precision=fp32", "--set", "train.seq_len=32", "--set", "train.micro_batch=4", "--set",
          "train.steps=100000", "--set", "train.warmup_steps=2", "--set", "monitor.log_every=1", "--set",
          "monitor.eval_every=0", "--set", "monitor.health_comm_share=0", "--set", "watchdog.straggler_factor=0",
          "--set", "checkpoint.resume=false"]


def _job_pids(job_id: str) -> list[int]:
    return descendants([p.pid for p in processes()
                        if (environment(p.pid) or {}).get(b"SLURM_JOB_ID") == job_id.encode()])


def _submit(cwd: Path, every_steps: int, *extra: str) -> tuple[str, Path]:
    out = subprocess.run([sys.executable, "-m", "hpc_train.submit", str(REPO / "examples" / "tiny_gpt.toml"), *COMMON,
                          "--set", f"checkpoint.every_steps={every_steps}", *extra, "--no-follow"], cwd=cwd,
                         capture_output=True, text=True, timeout=300, check=True).stdout
    (job_id,) = re.findall(r"submitted job (\d+)", out)
    return job_id, (cwd / "runs" / "tiny-gpt").resolve()


def _cancel(job_id: str, timeout_s: float = 120) -> None:
    """Cancel the job and wait until it has left the queue: its ranks write into the run folder until then."""
    subprocess.run(["scancel", job_id], check=False, timeout=60)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        queued = subprocess.run(["squeue", "-h", "-j", job_id], capture_output=True, text=True, timeout=30,
                                check=False).stdout.strip()
        if not queued:
            return
        time.sleep(0.5)


def _until_step(run_dir: Path, step: int, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while last_logged_step(run_dir) < step:
        if time.monotonic() > deadline:
            raise RuntimeError(f"step {step} not reached in {run_dir}")
        time.sleep(0.5)


def _trace(job_id: str, run_dir: Path, seconds: float, exclude: tuple[str, ...]) -> tuple[float, Any]:
    ops = trace_folder_ops(_job_pids(job_id), run_dir, seconds, exclude=exclude)
    return ops.per_process_second(processes=NODES * TASKS), ops


def _kill_rank(job_id: str, rank: int) -> None:
    """SIGKILL to rank ``rank``'s process (the agent's child running hpc_train.launch), as a crash would."""
    for process in processes():
        env = environment(process.pid) or {}
        if (env.get(b"SLURM_JOB_ID") == job_id.encode() and env.get(b"SLURM_PROCID") == str(rank).encode()
                and b"hpc_train.launch" in (command_line(process.pid) or b"")):
            os.kill(process.pid, signal.SIGKILL)
            return
    raise RuntimeError(f"rank {rank} of job {job_id} was not found")


def measure(tmp: Path, seconds: float) -> dict[str, Any]:
    """(ops per rank per second, the trace) of each window, and the run folder's files per node."""
    results: dict[str, Any] = {}
    steady_dir, saving_dir = tmp / "steady", tmp / "saving"
    steady_dir.mkdir()
    saving_dir.mkdir()
    job_id, run_dir = _submit(steady_dir, every_steps=0)
    try:
        _until_step(run_dir, 25)
        results["steady training"] = _trace(job_id, run_dir, seconds, ("checkpoints",))
        threading.Timer(1.0, _kill_rank, (job_id, 1)).start()  # a restart in place inside the window
        results["a restart in place (rank 1 killed)"] = _trace(job_id, run_dir, seconds, ("checkpoints",))
    finally:
        _cancel(job_id)
    results["files per node, steady job"] = sum(len(n) for _, _, n in os.walk(run_dir)) / NODES
    # no restart in this job: no standby ranks importing torch beside the traced ranks for a life that never comes
    job_id, run_dir = _submit(saving_dir, 20, "--set", "retry.standby=false")
    try:
        _until_step(run_dir, 25)
        results["saving every 20 steps, checkpoints/ aside"] = _trace(job_id, run_dir, seconds, ("checkpoints",))
        results["saving every 20 steps, all"] = _trace(job_id, run_dir, seconds, ())
    finally:
        _cancel(job_id)
    outside = [os.path.join(p, n) for p, _, names in os.walk(run_dir) for n in names
               if "checkpoints" not in Path(p).parts]
    results["files per node outside checkpoints/, saving job"] = len(outside) / NODES
    results["  of them in logs/"] = sum("/logs/" in path for path in outside) / NODES
    newest = max((run_dir / "checkpoints").glob("step-*"))
    inside = [Path(p, n).relative_to(newest) for p, _, names in os.walk(newest) for n in names]
    results["files per node in one checkpoint"] = len(inside) / NODES
    results["  of them hpc_train's own (rng/, manifest)"] = sum(
        path.parts[0] == "rng" or path.name == "manifest.json" for path in inside) / NODES
    results["  of them DeepSpeed's (state/, latest, its scripts)"] = sum(
        path.parts[0] != "rng" and path.name != "manifest.json" for path in inside) / NODES
    return results


def cluster_section(args: argparse.Namespace) -> list[Any]:
    """Prints its own lines (its figures are rates and counts, not the login section's seconds): no rows."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="control-plane-cluster-", ignore_cleanup_errors=True) as tmp:
        results = measure(Path(tmp), 4.0 if args.smoke else 10.0)
    for what, value in results.items():
        if isinstance(value, tuple):
            rate, ops = value
            print(f"cluster: {what}: {rate:.3f} run-folder operations per rank per second\n{ops.describe()}")
        else:
            print(f"cluster: {what}: {value:.1f}")
    return []
