"""The whole path on submitit's local executor with real processes: plan, run folder, gloo all-reduce."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hpc_train.run.node_log import node_log_name, rank_log_text
from tests.conftest import REPO

pytestmark = pytest.mark.slow
EXAMPLE = str(REPO / "examples" / "tiny_gpt.toml")
SMOKE = ["--set", "job.program=smoke"]  # these tests check the path, not the model


@pytest.mark.parametrize("ranks", [2, 4])
def test_submit_local_runs_every_rank_in_one_group(tmp_path: Path, ranks: int) -> None:
    result = subprocess.run([sys.executable, "-m", "hpc_train.submit", EXAMPLE, "--site", "local", *SMOKE,
                             "--set", f"job.tasks_per_node={ranks}"], cwd=tmp_path, capture_output=True, text=True,
                            timeout=240, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "completed" in result.stdout and "rank0 | " in result.stdout
    run_dir = tmp_path / "runs" / "tiny-gpt"
    smoke = json.loads((run_dir / "smoke.json").read_text())
    assert smoke["world_size"] == ranks and smoke["all_reduce"] == ranks * (ranks - 1) / 2
    assert smoke["backend"] == "gloo" and smoke["launcher"] == "submitit-local"
    for rank in range(ranks):
        assert "smoke: all_reduce of ranks" in rank_log_text(run_dir, rank)
    assert sorted(p.name for p in (run_dir / "logs").glob("rank*.log")) == [node_log_name(0, ranks)]  # one node
    assert (run_dir / "plan.json").exists() and (run_dir / "config.toml").exists()
    assert oct((run_dir / "submitit").stat().st_mode & 0o777) == "0o700"
    [fabric] = [json.loads(path.read_text()) for path in (run_dir / "logs").glob("fabric-*.json")]  # one node
    assert fabric["findings"] == [] and fabric["env"]["NCCL_IB_DISABLE"] == "1", fabric


def test_eight_ranks_build_every_group_of_a_3d_layout(tmp_path: Path) -> None:
    """tensor 2 x context 2 x pipeline 2 on 8 processes: each rank checks its groups by all-reduce."""
    result = subprocess.run([sys.executable, "-m", "hpc_train.submit", EXAMPLE, "--site", "local", *SMOKE,
                             "--set", "job.tasks_per_node=8", "--set", "parallel.tensor=2", "--set",
                             "parallel.context=2", "--set", "parallel.pipeline=2", "--set", "zero.stage=1"],
                            cwd=tmp_path, capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    run_dir = tmp_path / "runs" / "tiny-gpt"
    smoke = json.loads((run_dir / "smoke.json").read_text())
    assert smoke["groups"] == {"tp": [0, 1], "cp": [0, 2], "dp": [0], "pp": [0, 4]}
    for rank in range(8):
        assert "groups checked" in rank_log_text(run_dir, rank)


def test_a_leaked_master_addr_does_not_win(tmp_path: Path) -> None:
    """A MASTER_ADDR in the submitting shell would point the ranks at the wrong host; the bootstrap owns it."""
    env = {"PATH": "/usr/bin:/bin", "MASTER_ADDR": "203.0.113.7", "MASTER_PORT": "1", "HOME": str(tmp_path)}
    result = subprocess.run([sys.executable, "-m", "hpc_train.submit", EXAMPLE, "--site", "local", *SMOKE],
                            cwd=tmp_path,
                            env=env, capture_output=True, text=True, timeout=240, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "rendezvous 127.0.0.1:" in result.stdout


def test_the_quick_start_says_no_health_finding(tmp_path: Path) -> None:
    """The quick start's job (scripts/quickstart.sh, fewer steps): two CPU ranks on one node over gloo are not
    a network problem, so the comm check does not flag their expected traffic, and nothing else trips. A
    straggler finding is left out: it is this machine's load (a loaded CI once slowed rank 1 to 1.6x the
    median forward for 10 steps), which that check is right to report."""
    result = subprocess.run([sys.executable, "-m", "hpc_train.submit", EXAMPLE, "--site", "local", "--set",
                             "checkpoint.resume=false", "--set", "train.steps=80"], cwd=tmp_path,
                            capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    assert not [line for line in result.stdout.splitlines() if "health:" in line and "straggler" not in line], \
        result.stdout
    lines = result.stdout.splitlines()  # the ranks' last lines come before the state they ended in
    ended = next(i for i, line in enumerate(lines) if line.startswith("job ") and line.endswith(": COMPLETED"))
    assert not [line for line in lines[ended:] if line.startswith("rank0 |")], lines[ended - 3:]
    health = tmp_path / "runs" / "tiny-gpt" / "health.json"  # written once a check trips
    findings = json.loads(health.read_text())["findings"] if health.exists() else []
    assert not [finding for finding in findings if finding["check"] != "straggler"], health.read_text()
