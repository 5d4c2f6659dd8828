"""What a real 2-node Slurm job asks of its run folder in steady training, every process of the job traced (the
agents above the ranks, the ranks, their threads and children): at most 0.1 metadata operations per rank per
second, checkpoints aside, with nothing left out. The agents and the ranks coordinate over the job's coordinator
(hpc_train.control), not by polling files (issue 38; docs/architecture.md, "The control plane")."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hpc_train.run.procs import environment, processes
from hpc_train.run.watch import last_logged_step
from tests.conftest import REPO
from tests.strace_ops import StraceUnavailableError, descendants, ensure_strace, trace_folder_ops

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("slurm_cluster")]

LIMIT = 0.1  # run-folder metadata operations per rank per second
TRACE_S = 10.0
STEADY_STEP = 25
RANKS = 2
# No checkpoint and no eval in the window. The comm and straggler checks are off: two CPU ranks sharing two cores
# trip and clear them every few steps, and rank 0 then rewrites health.json (4 operations, at most every 10 s: a
# write of the whole job, 0.0002 per rank per second at 16,384 ranks, but 0.2 in a 2-rank job's 10 s window).
ARGS = ["--site", "local-slurm", "--set", "job.nodes=2", "--set", "job.tasks_per_node=1", "--set",
        "train.precision=fp32", "--set", "train.seq_len=32", "--set", "train.micro_batch=4", "--set",
        "train.steps=100000", "--set", "train.warmup_steps=2", "--set", "monitor.log_every=1", "--set",
        "monitor.eval_every=0", "--set", "monitor.health_comm_share=0", "--set", "watchdog.straggler_factor=0",
        "--set", "checkpoint.every_steps=0",
        "--set", "checkpoint.resume=false"]


def _job_processes(job_id: str) -> list[int]:
    """Every process of the job on the local cluster's nodes (all on this machine): its environment says so."""
    return [process.pid for process in processes()
            if (environment(process.pid) or {}).get(b"SLURM_JOB_ID") == job_id.encode()]


def _steady(job_id: str, run_dir: Path, timeout_s: float = 240) -> None:
    deadline = time.monotonic() + timeout_s
    while last_logged_step(run_dir) < STEADY_STEP:
        state = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T"], capture_output=True, text=True,
                               timeout=30, check=False).stdout.strip()
        logs = "\n".join(p.read_text(errors="replace")[-2000:] for p in sorted((run_dir / "logs").glob("*.log")))
        assert state in ("PENDING", "CONFIGURING", "RUNNING"), f"job {job_id} is {state!r}\n{logs}"
        assert time.monotonic() < deadline, f"job {job_id} did not log step {STEADY_STEP}\n{logs}"
        time.sleep(0.5)


def test_a_two_node_job_in_steady_training_leaves_the_run_folder_alone(tmp_path: Path) -> None:
    try:
        ensure_strace()
    except StraceUnavailableError as why:
        pytest.skip(str(why))
    submitted = subprocess.run([sys.executable, "-m", "hpc_train.submit", str(REPO / "examples" / "tiny_gpt.toml"),
                                *ARGS, "--no-follow"], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                               check=False)
    assert submitted.returncode == 0, submitted.stdout[-3000:] + submitted.stderr[-3000:]
    (job_id,) = re.findall(r"submitted job (\d+)", submitted.stdout)
    run_dir = (tmp_path / "runs" / "tiny-gpt").resolve()
    try:
        _steady(job_id, run_dir)
        first = last_logged_step(run_dir)
        ops = trace_folder_ops(descendants(_job_processes(job_id)), run_dir, TRACE_S)
        trained = last_logged_step(run_dir) - first
    finally:
        subprocess.run(["scancel", job_id], check=False, timeout=30)
    assert trained > 0, "no step was trained while traced"
    assert (run_dir / "heartbeats" / f"control-{job_id}.0.json").exists(), "no coordinator was started"
    if ops.by_call["rename", "health.json"]:  # a finding tripped under load: rank 0's record of an event, its
        ops = ops.without(("health.json", ".health.json.tmp-*", "."))  # temporary file and the folder's fsync
    rate = ops.per_process_second(processes=RANKS)
    print(f"traced {trained} steps: {rate:.3f} per rank per second\n{ops.describe()}")  # shown with pytest -s
    assert rate <= LIMIT, (f"{rate:.3f} run-folder metadata operations per rank per second in steady training "
                           f"(limit {LIMIT}; {trained} steps traced):\n{ops.describe()}")
