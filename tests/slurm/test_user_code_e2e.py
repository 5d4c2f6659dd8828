"""User programs on the real local Slurm cluster, 2 nodes x 1 rank: an unmodified DDP script through the rendered
srun and torchrun sbatch scripts ends with ``torchrun``'s weights; in a ``--sweep params.x`` job array of a
function (submitit), the task sent ``scancel --signal=USR2`` twice requeues itself alone and ends bitwise equal to
the task never stopped, with every step logged once."""

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

from hpc_train.run.node_log import rank_log_text
from tests.conftest import REPO, torchrun
from tests.rank.program.test_runner_local import OWN_LOOP, attempts, final_model
from tests.slurm.test_preemption_e2e import NO_STANDBY, _state, _wait_for_step, _wait_until_completed

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
    result = torchrun([str(REPO / "examples" / "ddp_script" / "train_cnn.py"), "--epochs", "2", "--out", str(out)],
                      out.parent, {**os.environ, "OMP_NUM_THREADS": "1"}, timeout=300)
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
    log = rank_log_text(run_dir, 0)
    assert _state(job_id) == "COMPLETED", log[-3000:]
    assert "node 1/2" in rank_log_text(run_dir, 1)  # really on the second node
    assert "epoch 1: mean loss" in log
    ours = torch.load(out, weights_only=True)
    assert all(torch.equal(ours[k], torchrun_weights[k]) for k in torchrun_weights)


def _wait_for_stop(run_dir: Path, index: int) -> None:
    """Until attempt ``index`` (from 0) of the run has ended."""
    deadline = time.monotonic() + 120
    while len(attempts(run_dir)) <= index or attempts(run_dir)[index]["outcome"] == "running":
        assert time.monotonic() < deadline, f"attempt {index + 1} did not end\n{attempts(run_dir)}"
        time.sleep(0.2)


def test_a_swept_function_sent_usr2_twice_requeues_its_task_alone_and_ends_with_the_other_s_weights(
        tmp_path: Path) -> None:
    """``--sweep params.x=1,2`` of the own-loop function (x changes nothing it computes): one job array of two
    tasks, 2 nodes each. The second task gets ``scancel --signal=USR2`` twice; it requeues alone, as itself,
    resumes where it saved, logs every step once, and ends bitwise equal to the first task, never stopped."""
    result = subprocess.run([sys.executable, "-m", "hpc_train.submit", OWN_LOOP, *TWO_NODES, "--set",
                             f"params.steps={STEPS}", "--set", "params.save_every=1000", "--set",
                             "params.step_sleep=0.1", *NO_STANDBY, "--sweep", "params.x=1,2", "--no-follow"],
                            cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    ids = re.findall(r"submitted job (\d+_\d+)", result.stdout)
    assert len(ids) == 2, result.stdout
    runs = [tmp_path / "runs" / f"own-loop-{index:03d}" for index in range(2)]
    for index, step in enumerate((8, 25)):
        _wait_for_step(ids[1], runs[1], step)
        while len(attempts(runs[1])) < index + 1 or attempts(runs[1])[index]["outcome"] != "running":
            time.sleep(0.2)
        subprocess.run(["scancel", "--signal=USR2", ids[1]], check=True, timeout=30)
        _wait_for_stop(runs[1], index)
    for job_id, run_dir in zip(ids, runs, strict=True):
        _wait_until_completed(job_id, run_dir)
    plain, stopped = attempts(runs[0]), attempts(runs[1])
    assert [a["outcome"] for a in plain] == ["completed"], plain
    assert [a["outcome"] for a in stopped] == ["preempted", "preempted", "completed"], stopped
    # scontrol requeue ARRAY_TASK: the array's own id would have requeued the first task too
    assert all(a["requeued"] and a["note"] == f"scontrol requeue {ids[1]}" for a in stopped[:2]), stopped
    assert len({a["job_id"] for a in stopped}) == 1
    assert [a["start_step"] for a in stopped[1:]] == [a["end_step"] for a in stopped[:2]]
    for run_dir, x in zip(runs, (1, 2), strict=True):
        logged = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        assert logged == list(range(1, STEPS + 1))
        assert json.loads((run_dir / "plan.json").read_text())["config"]["params"]["x"] == x
    reference, resumed = final_model(runs[0]), final_model(runs[1])
    assert all(torch.equal(resumed[k], reference[k]) for k in reference)
