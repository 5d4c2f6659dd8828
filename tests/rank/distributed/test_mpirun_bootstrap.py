"""``mpirun -np 4`` with no Slurm and no MASTER_ADDR: ranks come from Open MPI, the rendezvous from rank 0 over
mpi4py, then one gloo group (real Open MPI, real processes)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.slow


def test_mpirun_np4_bootstrap(tmp_path: Path) -> None:
    if shutil.which("mpirun") is None:
        if os.environ.get("HPC_TRAIN_REQUIRE_SLURM") == "1":
            pytest.fail("mpirun is missing although scripts/test.sh installs openmpi-bin as root")
        pytest.skip("needs Open MPI's mpirun (apt-get install openmpi-bin; scripts/test.sh does it as root)")
    rendered = subprocess.run([sys.executable, "-m", "hpc_train", "render", str(REPO / "examples" / "tiny_gpt.toml"),
                               "--site", "local-slurm", "--set", "job.tasks_per_node=4", "--set", "job.program=smoke",
                               "--set", "parallel.tensor=2", "--json"], cwd=tmp_path, capture_output=True, text=True,
                              check=True, timeout=60)
    run_dir = json.loads(rendered.stdout)["run_dir"]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "MASTER_", "RANK", "WORLD_SIZE"))}
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", OMP_NUM_THREADS="1")
    result = subprocess.run(["mpirun", "-np", "4", "--oversubscribe", "--bind-to", "none", sys.executable, "-m",
                             "hpc_train.launch", run_dir], env=env, capture_output=True, text=True, timeout=180,
                            check=False)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    smoke = json.loads((Path(run_dir) / "smoke.json").read_text())
    assert smoke["launcher"] == "openmpi" and smoke["world_size"] == 4 and smoke["all_reduce"] == 6
    assert smoke["groups"]["tp"] == [0, 1] and smoke["groups"]["dp"] == [0, 2]
