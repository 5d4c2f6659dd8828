"""User programs on the real local Slurm cluster, 2 nodes x 1 rank: an unmodified DDP script through the rendered
srun and torchrun sbatch scripts ends with ``torchrun``'s weights; a function sent ``scancel --signal=USR2``
several times (submitit) ends bitwise equal to an uninterrupted run with every step logged once; the runs of a
``--sweep params.x`` job array each see their own value, and a preempted array task requeues itself alone."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from hpc_train.run.watch import last_logged_step
from tests.conftest import REPO, free_port
from tests.program.test_runner_local import OWN_LOOP, attempts, final_model, submit
from tests.slurm.test_preemption_e2e import _state, _wait_for_step, _wait_until_completed

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("slurm_cluster")]
TWO_NODES = ["--site", "local-slurm", "--set", "job.nodes=2", "--set", "job.tasks_per_node=1", "--set",
             "job.cpus_per_task=1"]  # one thread per rank, as torchrun and the local runs have
STEPS = 60


def _run(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "hpc_train", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=300, check=False)


def _sbatch(script: str) -> str:
    return subprocess.run(["sbatch", "--parsable", script], capture_output=True, text=True, check=True,
                          timeout=30).stdout.strip().split(";")[0]


@pytest.fixture(scope="module")
def torchrun_weights(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    out = tmp_path_factory.mktemp("torchrun") / "weights.pt"
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                             f"--master_port={free_port()}", str(REPO / "examples" / "ddp_script" / "train_cnn.py"),
                             "--epochs", "2", "--out",
                             str(out)], capture_output=True, text=True, timeout=300,
                            env={**os.environ, "OMP_NUM_THREADS": "1"}, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    return torch.load(out, weights_only=True)


@pytest.mark.parametrize("template", ["srun", "torchrun"])
def test_a_ddp_script_through_the_sbatch_templates_ends_with_torchrun_s_weights(
        torchrun_weights: dict[str, torch.Tensor], tmp_path: Path, template: str) -> None:
    out = tmp_path / "weights.pt"
    rendered = _run(tmp_path, "render", str(REPO / "examples" / "ddp_script" / "job.toml"), *TWO_NODES, "--set",
                    f'job.args=["--epochs", "2", "--out", "{out}"]', "--template", template, "--json")
    assert rendered.returncode == 0, rendered.stderr
    job_id = _sbatch(json.loads(rendered.stdout)["script"])
    run_dir = tmp_path / "runs" / "ddp-cnn"
    deadline = time.monotonic() + 240
    while _state(job_id) not in {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL"}:
        assert time.monotonic() < deadline, f"job {job_id} did not end"
        time.sleep(1)
    log = (run_dir / "logs" / "rank-0.log").read_text()
    assert _state(job_id) == "COMPLETED", log[-3000:]
    assert "node 1/2" in (run_dir / "logs" / "rank-1.log").read_text()  # really on the second node
    assert "epoch 1: mean loss" in log
    ours = torch.load(out, weights_only=True)
    assert all(torch.equal(ours[k], torchrun_weights[k]) for k in torchrun_weights)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    """The function on the local executor, 2 ranks on one machine: the cluster's 2 nodes must give the same."""
    work = tmp_path_factory.mktemp("plain")
    code, output = submit(work, OWN_LOOP, f"params.steps={STEPS}", "params.save_every=1000", "job.cpus_per_task=1")
    assert code == 0, output[-3000:]
    return final_model(work / "runs" / "own-loop")


def test_a_function_sent_usr2_several_times_ends_with_the_uninterrupted_weights(
        uninterrupted: dict[str, torch.Tensor], tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, "-m", "hpc_train.submit", OWN_LOOP, *TWO_NODES, "--set",
                             f"params.steps={STEPS}", "--set", "params.save_every=1000", "--set",
                             "params.step_sleep=0.1", "--no-follow"], cwd=tmp_path, capture_output=True, text=True,
                            timeout=120, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    (job_id,) = re.findall(r"submitted job (\d+)", result.stdout)
    run_dir = tmp_path / "runs" / "own-loop"
    for index, step in enumerate((8, 25)):
        _wait_for_step(job_id, run_dir, step)
        while len(attempts(run_dir)) < index + 1 or attempts(run_dir)[index]["outcome"] != "running":
            time.sleep(0.2)
        subprocess.run(["scancel", "--signal=USR2", job_id], check=True, timeout=30)
        deadline = time.monotonic() + 120
        while attempts(run_dir)[index]["outcome"] == "running":
            assert time.monotonic() < deadline, "no stop after the signal"
            time.sleep(0.2)
    _wait_until_completed(job_id, run_dir)
    runs = attempts(run_dir)
    assert [a["outcome"] for a in runs] == ["preempted", "preempted", "completed"], runs
    assert all(a["requeued"] and a["note"] == f"scontrol requeue {job_id}" for a in runs[:2])
    assert [a["start_step"] for a in runs[1:]] == [a["end_step"] for a in runs[:2]]
    logged = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert logged == list(range(1, STEPS + 1))
    resumed = final_model(run_dir)
    assert all(torch.equal(resumed[k], uninterrupted[k]) for k in uninterrupted)


SWEPT = """
import time


def main(ctx):
    start = ctx.checkpoint.load({"x": None}) or 0
    for step in range(start + 1, 31):
        ctx.log(step, x=ctx.params["x"])
        time.sleep(0.1)
        if ctx.should_stop():
            ctx.checkpoint.save(step, {"x": ctx.params["x"]})
            return
"""


def test_a_sweep_of_params_is_a_job_array_whose_preempted_task_requeues_as_itself(tmp_path: Path) -> None:
    (tmp_path / "swept.py").write_text(SWEPT)
    (tmp_path / "job.toml").write_text('[job]\nname = "swept"\nprogram = "swept.py:main"\n[params]\nx = 0\n')
    result = subprocess.run([sys.executable, "-m", "hpc_train.submit", str(tmp_path / "job.toml"), "--site",
                             "local-slurm", "--set", "job.cpus_per_task=1", "--sweep", "params.x=1,2", "--no-follow"],
                            cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    ids = re.findall(r"submitted job (\d+_\d+)", result.stdout)
    assert len(ids) == 2, result.stdout
    runs = [tmp_path / "runs" / f"swept-{index:03d}" for index in range(2)]
    _wait_for_step(ids[1], runs[1], 5)
    subprocess.run(["scancel", "--signal=USR2", ids[1]], check=True, timeout=30)  # the second task only
    for job_id, run_dir in zip(ids, runs, strict=True):
        _wait_until_completed(job_id, run_dir)
    first, second = attempts(runs[0]), attempts(runs[1])
    assert [a["outcome"] for a in first] == ["completed"]
    assert [a["outcome"] for a in second] == ["preempted", "completed"], second
    # The task requeued itself alone (scontrol requeue 171 could name the whole array) and came back as itself.
    assert second[0]["requeued"] and second[0]["note"] == f"scontrol requeue {ids[1]}"
    assert len({a["job_id"] for a in second}) == 1
    for run_dir, x in zip(runs, (1, 2), strict=True):
        records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in records] == list(range(1, 31)) and {r["x"] for r in records} == {x}
    assert last_logged_step(runs[1]) == 30
