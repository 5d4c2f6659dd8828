"""A non-editable wheel carries the templates and site configs: build it, install it into a fresh virtual
environment, and render a script from a folder that is not the checkout."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.slow


def test_wheel_renders_from_a_fresh_venv(tmp_path: Path) -> None:
    dist = tmp_path / "dist"
    subprocess.run([sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(dist), str(REPO)],
                   check=True, capture_output=True, timeout=300)
    wheel = next(dist.glob("hpc_train-*.whl"))
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    install = subprocess.run([str(python), "-m", "pip", "install", "-q", str(wheel)], capture_output=True, text=True,
                             timeout=600, check=False)
    assert install.returncode == 0, install.stderr
    work = tmp_path / "elsewhere"
    work.mkdir()
    where = subprocess.run([str(python), "-c", "from hpc_train.resources import shipped_dir as d; "
                            "print(d('site_configs')); print(d('sbatch_templates'))"],
                           cwd=work, capture_output=True, text=True, check=True).stdout.split()
    assert all(path.startswith(str(venv)) for path in where), where  # from the wheel, not the checkout
    assert all(any(Path(path).iterdir()) for path in where)
    job = work / "job.toml"
    job.write_text('[job]\nname = "from-wheel"\nnodes = 2\ntasks_per_node = 2\n', encoding="utf-8")
    for template in ("srun", "torchrun", "mpirun"):
        rendered = subprocess.run([str(python), "-m", "hpc_train", "render", str(job), "--site", "local-slurm",
                                   "--template", template, "--json"], cwd=work, capture_output=True, text=True,
                                  timeout=60, check=False)
        assert rendered.returncode == 0, rendered.stderr
        script = Path(json.loads(rendered.stdout)["script"])
        assert script.read_text().startswith("#!/bin/bash -l\n#SBATCH --job-name=from-wheel\n")
        assert subprocess.run(["bash", "-n", str(script)], check=False).returncode == 0
