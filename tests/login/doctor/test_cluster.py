"""doctor against the real local Slurm cluster (scripts/local_slurm.sh): the probe job runs on n1 and n2.

Kept to four short runs (about a second each): the probe is a real sbatch job, signalled with scancel.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("slurm_cluster")]
JOB = '[job]\nname = "doctor-e2e"\nnodes = 2\ntasks_per_node = 1\ntime = "00:10:00"\n'


def _doctor(tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> tuple[int, dict[str, Any]]:
    (tmp_path / "job.toml").write_text(JOB)
    done = subprocess.run([sys.executable, "-m", "hpc_train", "doctor", "--site", "local-slurm", *args, "--json"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180, check=False)
    assert done.returncode in (0, 1), done.stdout + done.stderr
    return done.returncode, json.loads(done.stdout)


def test_the_probe_finds_a_user_program_on_every_node(tmp_path: Path) -> None:
    (tmp_path / "loop.py").write_text("def main(ctx):\n    pass\n")
    code, data = _doctor(tmp_path, "--config", "job.toml", "--set", "job.program=loop.py:main")
    assert code == 0, data["findings"]
    (finding,) = _by_check(data)["code folder"]
    assert finding["severity"] == "ok" and finding["message"] == f"the program {tmp_path}/loop.py is visible on n1, n2"


def _by_check(data: dict[str, Any]) -> dict[str, list[dict[str, str]]]:
    checks: dict[str, list[dict[str, str]]] = {}
    for finding in data["findings"]:
        checks.setdefault(finding["check"], []).append(finding)
    return checks


def _job_is_gone(job_id: str) -> None:
    queue = subprocess.run(["squeue", "--noheader", "--jobs", job_id, "--format=%i %T"], capture_output=True,
                           text=True, timeout=30, check=False)
    assert job_id not in queue.stdout or "COMPLETING" in queue.stdout, queue.stdout


def test_probe_reaches_every_rank_on_two_nodes(tmp_path: Path) -> None:
    code, data = _doctor(tmp_path, "--config", "job.toml")
    checks = _by_check(data)
    assert code == 0, data["findings"]
    for check in ("slurm", "partition", "probe", "run folder"):
        assert [f["severity"] for f in checks[check]] == ["ok"], checks[check]
    assert "SIGUSR2 reached all 2 ranks on n1, n2" in checks["probe"][0]["message"]
    ranks = data["probe"]["ranks"]
    assert [(r["rank"], r["node"], r["token_ok"], r["signal"]) for r in ranks] == [(0, "n1", True, True),
                                                                                   (1, "n2", True, True)]
    _job_is_gone(data["probe"]["job_id"])
    assert list((tmp_path / "runs" / ".doctor").iterdir()) == []  # the probe folder is removed after a pass


def test_site_alone_probes_two_ranks_per_node(tmp_path: Path) -> None:
    code, data = _doctor(tmp_path, "--ntasks-per-node", "2")
    assert code == 0, data["findings"]
    assert {r["node"] for r in data["probe"]["ranks"]} == {"n1", "n2"} and len(data["probe"]["ranks"]) == 4
    assert all(r["signal"] for r in data["probe"]["ranks"])


def test_a_job_larger_than_the_partition_is_an_error(tmp_path: Path) -> None:
    code, data = _doctor(tmp_path, "--config", "job.toml", "--set", "job.nodes=3")
    assert code == 1
    (error,) = [f for f in data["findings"] if f["severity"] == "error"]
    assert error["check"] == "partition"
    assert error["message"] == 'job.nodes = 3, but partition "batch" has 2 nodes'
    assert error["fix"] == "set job.nodes <= 2, or choose another partition"
    assert data["probe"] is None and not (tmp_path / "runs").exists()  # nothing submitted


def test_an_unreachable_controller_is_an_error(tmp_path: Path) -> None:
    conf = re.sub(r"^SlurmctldPort=.*$", "SlurmctldPort=1", Path("/etc/slurm/slurm.conf").read_text(),
                  flags=re.MULTILINE)
    (tmp_path / "slurm.conf").write_text(conf)
    env = {**os.environ, "SLURM_CONF": str(tmp_path / "slurm.conf")}
    code, data = _doctor(tmp_path, "--config", "job.toml", env=env)
    assert code == 1
    (error,) = [f for f in data["findings"] if f["severity"] == "error"]
    assert error["check"] == "slurm" and error["message"].startswith("the Slurm controller does not answer (Slurmctld(")
    assert "SLURM_CONF" in error["fix"] and data["probe"] is None
