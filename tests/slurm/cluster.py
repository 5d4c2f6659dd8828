"""The local Slurm cluster (scripts/local_slurm.sh) as a test fixture, and helpers to wait on real jobs."""

from __future__ import annotations

import os
import re
import subprocess
import time

import pytest

from hpc_train.login.slurm.jobstate import query_states


def cluster_problem() -> str:
    """Why the local cluster cannot be used, or '' when it answers and has idle nodes."""
    try:
        ping = subprocess.run(["scontrol", "ping"], capture_output=True, text=True, timeout=20, check=False)
    except FileNotFoundError:
        return "Slurm is not installed"
    if " is UP" not in ping.stdout:
        return f"slurmctld does not answer: {ping.stdout.strip()} {ping.stderr.strip()}"
    nodes = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %t"], capture_output=True, text=True, timeout=20,
                           check=False)
    if not re.search(r"^n1 ", nodes.stdout, re.MULTILINE):
        return f"node n1 is missing: {nodes.stdout.strip()}"
    return ""


@pytest.fixture(scope="session")
def slurm_cluster() -> None:
    """Skip (or, where the cluster must exist, fail) when the local cluster is not up."""
    problem = cluster_problem()
    if not problem:
        return
    message = f"needs the local Slurm cluster (scripts/local_slurm.sh up, as root): {problem}"
    if os.environ.get("HPC_TRAIN_REQUIRE_SLURM") == "1":
        pytest.fail(message)
    pytest.skip(message)


def wait_for_job(job_id: str, timeout_s: float = 180) -> str:
    """Poll sacct until the job reaches a final state; return it."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        state = query_states([job_id]).get(job_id)
        if state and state.done:
            return state.state
        time.sleep(1)
    subprocess.run(["scancel", job_id], check=False)
    raise AssertionError(f"job {job_id} did not finish within {timeout_s} s")
