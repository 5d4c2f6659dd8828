"""Readers that watch a live run: they see what rank 0 has written so far and never fail on a torn line."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from hpc_train.run.paths import METRICS_FILE
from hpc_train.run.watch import last_logged_step, local_rank_pid, slurm_job_processes, slurm_rank_pid


def test_last_logged_step_reads_whole_lines_only(tmp_path: Path) -> None:
    assert last_logged_step(tmp_path) == 0
    (tmp_path / METRICS_FILE).write_text('{"step": 1, "loss": 2.0}\n{"step": 3, "loss": 1.5}\n{"step": 4, "lo')
    assert last_logged_step(tmp_path) == 3
    (tmp_path / METRICS_FILE).write_text('{"step": 2}\n[1, 2]\n{"eval_loss": 1.0}\n')
    assert last_logged_step(tmp_path) == 2


def test_no_rank_process_of_a_run_that_is_not_running(tmp_path: Path) -> None:
    assert local_rank_pid(tmp_path, 0) is None


_RANK = """
import os, sys, time
if os.fork() == 0:  # a data loader worker: the same command line and environment as its rank
    time.sleep(30)
    os._exit(0)
if sys.argv[1] == "leave":  # the rank of an attempt that ended; its worker outlives it
    os._exit(0)
time.sleep(30)
"""


def test_the_rank_is_found_not_its_workers_nor_an_old_attempts_orphan(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    env = {**os.environ, "SUBMITIT_LOCAL_GLOBALID": "1"}
    argv = [sys.executable, "-c", _RANK]
    marker = ["submitit.core._submit", str(run_dir / "submitit")]
    old = subprocess.Popen([*argv, "leave", *marker], env=env)
    old.wait()  # its worker lives on, an orphan
    time.sleep(0.2)
    rank = subprocess.Popen([*argv, "stay", *marker], env=env)
    try:
        deadline = time.monotonic() + 10
        while local_rank_pid(run_dir, 1) != rank.pid:
            assert time.monotonic() < deadline, local_rank_pid(run_dir, 1)
            time.sleep(0.05)
        assert local_rank_pid(run_dir, 0) is None
    finally:
        rank.kill()
        subprocess.run(["pkill", "-f", str(run_dir / "submitit")], check=False)


def test_a_slurm_job_s_rank_and_processes_are_found_by_their_environment() -> None:
    """What the Slurm tests and benchmarks kill: a rank by its job and rank, a node's processes by its name."""
    env = {**os.environ, "SLURM_JOB_ID": "987654", "SLURM_PROCID": "3", "SLURMD_NODENAME": "n7"}
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "hpc_train.launch"], env=env)
    try:
        deadline = time.monotonic() + 20
        while slurm_rank_pid("987654", 3) != child.pid:
            assert time.monotonic() < deadline, "the rank was not found"
            time.sleep(0.05)
        assert slurm_rank_pid("987654", 2) is None and slurm_rank_pid("987655", 3) is None
        assert slurm_job_processes("987654", "n7") == [child.pid] and slurm_job_processes("987654", "n8") == []
    finally:
        child.kill()
        child.wait()
