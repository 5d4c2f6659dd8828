"""The status view of a real job on the local Slurm cluster (scripts/local_slurm.sh up): a two-node job that
stays running (rank 1 sleeps, rank 0 waits for it) shows RUNNING on both nodes, every poll asks squeue once and
sacct once for all runs shown, and after scancel the view says cancelled."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from hpc_train.login.main import main
from tests.conftest import REPO, call_cli
from tests.failures.fixtures import write_plan

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("slurm_cluster")]
EXAMPLE = str(REPO / "examples" / "tiny_gpt.toml")
HOLD = ["--set", "job.nodes=2", "--set", "job.tasks_per_node=1", "--set", "job.program=smoke", "--set",
        "job.name=ops-status", "--set", "env.HPC_TRAIN_INJECT_FAULT=hang:1"]


def _poll(tmp_path: Path, runs: list[Path], calls: list[str]) -> dict[str, Any]:
    calls.clear()
    result = call_cli(main, ["status", *map(str, runs), "--json"], tmp_path)
    assert result.code == 0, result.err
    assert sorted(calls) == ["sacct", "squeue"], calls  # one batched call of each, for both runs
    return json.loads(result.out)


def _until(tmp_path: Path, runs: list[Path], calls: list[str], done: Callable[[dict[str, Any]], bool],
           timeout_s: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while True:
        data = _poll(tmp_path, runs, calls)
        if done(data["runs"][0]):
            return data
        assert time.monotonic() < deadline, json.dumps(data["runs"][0], indent=1)[:3000]
        time.sleep(1)


def test_status_of_a_real_running_job(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    submitted = subprocess.run([sys.executable, "-m", "hpc_train.submit", EXAMPLE, "--site", "local-slurm", *HOLD,
                                "--no-follow"], cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False)
    assert submitted.returncode == 0, submitted.stdout[-2000:] + submitted.stderr[-2000:]
    (job_id,) = re.findall(r"submitted job (\d+)", submitted.stdout)
    run_dir = tmp_path / "runs" / "ops-status"
    other = tmp_path / "runs" / "not-started"
    write_plan(other, "not-started")
    calls: list[str] = []
    real_run = subprocess.run

    def counting(argv: list[str], *args: Any, **kwargs: Any) -> subprocess.CompletedProcess[str]:
        calls.append(Path(argv[0]).name)
        return real_run(argv, *args, **kwargs)

    monkeypatch.setattr(subprocess, "run", counting)
    try:
        data = _until(tmp_path, [run_dir, other], calls, lambda run: run["state"] == "RUNNING", 90)
        run = data["runs"][0]
        assert (run["job_id"], run["nodes"], run["executor"]) == (job_id, "n[1-2]", "slurm")
        assert data["slurm"] == {"available": True, "notes": [], "calls": 2}
        assert data["runs"][1]["state"] == "NO JOB"
        view = call_cli(main, ["status", str(run_dir)], tmp_path).out
        assert re.search(rf"ops-status\s+RUNNING\s+{job_id}\s+n\[1-2\]", view), view
    finally:
        real_run(["scancel", job_id], check=False, timeout=30)
    data = _until(tmp_path, [run_dir, other], calls, lambda run: run["state"] == "CANCELLED", 30)
    assert data["runs"][0]["failure"]["class"] == "cancelled"
