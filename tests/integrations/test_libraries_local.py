"""Unmodified Hugging Face Trainer and accelerate scripts (``--plain``: the examples without their hpc_train lines)
on 2 ranks of the local executor end with weights bitwise equal to the same script under ``torchrun``; Lightning's
with its integration, preempted at its first epoch's end, too. Preempted on the local Slurm cluster, Hugging Face
Trainer's and accelerate's with their integration and Lightning's unmodified (the same path for any unmodified
script, through Slurm's requeue): tests/integrations/test_preemption_slurm.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hpc_train.run.node_log import rank_log_text
from tests.conftest import REPO, torchrun

pytestmark = pytest.mark.slow
LIBS = ("hf_trainer", "accelerate")  # unmodified Lightning: on Slurm, tests/integrations/test_preemption_slurm.py
FOLDER_ARG = {"lightning": "--checkpoints", "hf_trainer": "--output-dir", "accelerate": "--checkpoints"}
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def _args(lib: str, folder: Path, out: Path) -> list[str]:
    return ["--steps", "40", FOLDER_ARG[lib], str(folder), "--out", str(out), "--plain"]


def test_unmodified_library_scripts_on_the_local_executor_end_with_torchrun_s_weights(tmp_path: Path) -> None:
    """All four runs at once (two torchrun, two hpc_train): each is mostly imports on this machine."""
    processes = {}
    for lib in LIBS:
        script = str(REPO / "examples" / lib / "train.py")
        ref = tmp_path / f"{lib}-torchrun"
        processes[lib, "torchrun"] = subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--standalone",
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
        assert "completed" in outputs[lib, "hpc_train"] and "rank 1/2" in rank_log_text(
            tmp_path / f"{lib}-hpc_train" / "runs" / _job_name(lib), 1)
        reference = torch.load(tmp_path / f"{lib}-torchrun" / "weights.pt", weights_only=True)
        ours = torch.load(tmp_path / f"{lib}-hpc_train" / "weights.pt", weights_only=True)
        assert reference.keys() == ours.keys()
        assert all(torch.equal(ours[k], reference[k]) for k in reference), lib


def _job_name(lib: str) -> str:
    return {"lightning": "lightning-mlp", "hf_trainer": "hf-trainer-mlp", "accelerate": "accelerate-mlp"}[lib]


def test_lightning_with_the_integration_preempted_early_loses_no_step_and_ends_bitwise(tmp_path: Path) -> None:
    """The signal comes before the script's first own checkpoint and near the first epoch's end (16 steps): the
    callback's save at the stop is all there is to resume from (Lightning's ModelCheckpoint, which had saved nothing
    yet, must not write a newer last-v1.ckpt over it), and a stop at the epoch's last batch waits one step."""
    import json
    import signal
    import time

    from hpc_train.run.watch import local_rank_pid

    script = str(REPO / "examples" / "lightning" / "train.py")
    ref = tmp_path / "ref"
    baseline = torchrun([script, *_args("lightning", ref / "checkpoints", ref / "weights.pt")], tmp_path, ENV,
                        fresh=ref / "checkpoints")
    assert baseline.returncode == 0, baseline.stdout[-3000:] + baseline.stderr[-3000:]
    work, steps = tmp_path / "ours", tmp_path / "ours" / "steps.txt"
    work.mkdir()
    args = ["--steps", "40", "--checkpoints", str(work / "checkpoints"), "--out", str(work / "weights.pt"),
            "--step-sleep", "0.15", "--step-log", str(steps)]
    process = subprocess.Popen([sys.executable, "-m", "hpc_train.submit", str(REPO / "examples" / "lightning" /
                                "job.toml"), "--site", "local", "--set", f"job.args={json.dumps(args)}"], cwd=work,
                               env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    run_dir = work / "runs" / "lightning-mlp"
    deadline = time.monotonic() + 240
    while not (steps.exists() and len(steps.read_text().splitlines()) >= 14 and local_rank_pid(run_dir, 1)):
        assert process.poll() is None and time.monotonic() < deadline, process.communicate()[0][-3000:]
        time.sleep(0.02)
    os.kill(local_rank_pid(run_dir, 1), signal.SIGUSR2)  # one rank: the others learn of it from should_stop
    output, _ = process.communicate(timeout=300)
    assert process.returncode == 0, output[-3000:]
    attempts = [json.loads(line) for line in (run_dir / "attempts.jsonl").read_text().splitlines()]
    assert [a["outcome"] for a in attempts] == ["preempted", "completed"], attempts
    assert 15 <= attempts[0]["end_step"] <= 18 and attempts[0]["end_step"] != 16, attempts  # never at 16
    logged = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert logged == list(range(1, 41))
    reference = torch.load(ref / "weights.pt", weights_only=True)
    ours = torch.load(work / "weights.pt", weights_only=True)
    assert all(torch.equal(ours[k], reference[k]) for k in reference)
