"""The bench as a real 2-node Slurm job on the local cluster, submitted exactly as the docs say:
``sbatch -N2 --ntasks-per-node=1 --wrap "srun python -m hpc_train bench allreduce ... --out bench.json"``.

Nothing is set for the ranks: they find their place and the rendezvous from Slurm's variables alone.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.slurm.cluster import wait_for_job

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("slurm_cluster")]
SIZES = [1 << 10, 1 << 12, 1 << 14, 1 << 16, 1 << 18, 1 << 20]  # 1K..1M, x4


def _sbatch(tmp_path: Path, command: list[str]) -> str:
    """Submit ``srun COMMAND`` on 2 nodes x 1 task; the job id."""
    submitted = subprocess.run(
        ["sbatch", "--parsable", "-N2", "--ntasks-per-node=1", "--time=2", "--job-name=hpc_train-bench-test",
         f"--chdir={tmp_path}", "--output=bench-%j.out", "--wrap", shlex.join(["srun", *command])],
        capture_output=True, text=True, timeout=30, check=True)
    return submitted.stdout.strip().split(";")[0]


def test_allreduce_across_two_nodes(tmp_path: Path) -> None:
    job_id = _sbatch(tmp_path, [sys.executable, "-m", "hpc_train", "bench", "allreduce", "--sizes", "1K..1M",
                                "--iters", "5", "--warmup", "2", "--out", "bench.json"])
    state = wait_for_job(job_id, timeout_s=120)
    log = (tmp_path / f"bench-{job_id}.out").read_text()
    assert state == "COMPLETED", log

    report = json.loads((tmp_path / "bench.json").read_text())
    assert (report["op"], report["world_size"], report["where"], report["backend"]) == \
        ("allreduce", 2, "job (srun)", "gloo")
    # Each rank's SLURMD_NODENAME (sacct's NodeList can lag behind the COMPLETED state): the group spans both.
    assert report["hosts"] == ["n1", "n2"]
    assert report["rendezvous"].startswith("n1:")  # derived from SLURM_JOB_NODELIST and the job id
    assert "no NCCL log" in report["transport"] and report["socket_fallback"] is False
    assert [row["size"] for row in report["results"]] == SIZES
    for row in report["results"]:
        assert row["correct"] and row["world_size"] == 2
        assert row["busbw"] > 0 and row["busbw"] == pytest.approx(row["algbw"])  # 2(n-1)/n = 1 on 2 ranks
        assert row["copy_gbps"] > 0

    assert log.count("# allreduce on 2 ranks, job (srun), gloo on cpu, 2 nodes (n1, n2)") == 1  # rank 0 only
    assert "# transport: gloo over TCP" in log and "error" not in log
