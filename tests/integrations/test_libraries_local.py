"""Unmodified Lightning, Hugging Face Trainer and accelerate scripts (``--plain``: the examples without their
hpc_train lines) on 2 ranks of the local executor end with weights bitwise equal to the same script under
``torchrun``. Preempted on the local Slurm cluster, with and without the integrations:
tests/integrations/test_preemption_slurm.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO, free_port

pytestmark = pytest.mark.slow
LIBS = ("lightning", "hf_trainer", "accelerate")
FOLDER_ARG = {"lightning": "--checkpoints", "hf_trainer": "--output-dir", "accelerate": "--checkpoints"}
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def _args(lib: str, folder: Path, out: Path) -> list[str]:
    return ["--steps", "40", FOLDER_ARG[lib], str(folder), "--out", str(out), "--plain"]


def test_unmodified_library_scripts_on_the_local_executor_end_with_torchrun_s_weights(tmp_path: Path) -> None:
    """All six runs at once (three torchrun, three hpc_train): each is mostly imports on this machine."""
    processes = {}
    for lib in LIBS:
        script = str(REPO / "examples" / lib / "train.py")
        ref = tmp_path / f"{lib}-torchrun"
        processes[lib, "torchrun"] = subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
             script, *_args(lib, ref / "checkpoints", ref / "weights.pt")], cwd=tmp_path, env=ENV,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        ours = tmp_path / f"{lib}-hpc_train"
        ours.mkdir()
        processes[lib, "hpc_train"] = subprocess.Popen(
            [sys.executable, "-m", "hpc_train.submit", str(REPO / "examples" / lib / "job.toml"), "--site", "local",
             "--set", "job.args=" + repr(_args(lib, ours / "checkpoints", ours / "weights.pt")).replace("'", '"')],
            cwd=ours, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    outputs = {key: process.communicate(timeout=600)[0] for key, process in processes.items()}
    for key, process in processes.items():
        assert process.returncode == 0, f"{key}:\n{outputs[key][-4000:]}"
    for lib in LIBS:
        assert "completed" in outputs[lib, "hpc_train"] and "rank 1/2" in (
            tmp_path / f"{lib}-hpc_train" / "runs" / _job_name(lib) / "logs" / "rank-1.log").read_text()
        reference = torch.load(tmp_path / f"{lib}-torchrun" / "weights.pt", weights_only=True)
        ours = torch.load(tmp_path / f"{lib}-hpc_train" / "weights.pt", weights_only=True)
        assert reference.keys() == ours.keys()
        assert all(torch.equal(ours[k], reference[k]) for k in reference), lib


def _job_name(lib: str) -> str:
    return {"lightning": "lightning-mlp", "hf_trainer": "hf-trainer-mlp", "accelerate": "accelerate-mlp"}[lib]
