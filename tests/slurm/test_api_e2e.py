"""``hpc_train.Executor`` on the real local Slurm cluster, 2 nodes of one rank each: a function's result, a
failure's class, a function preempted with ``scancel --signal=USR2``, requeued by Slurm and resumed from its own
checkpoint whose result is the uninterrupted one, an array of 3, ``hpc_train cancel`` and ``Job.cancel()``."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import cloudpickle
import pytest
import torch

import hpc_train
from tests.slurm.test_preemption_e2e import _wait_for_step

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("slurm_cluster")]
# the nodes run in a folder where this test module cannot be imported: its functions travel by value
cloudpickle.register_pickle_by_value(sys.modules[__name__])
TWO_NODES = {"site": "local-slurm", "nodes": 2, "tasks_per_node": 1, "cpus_per_task": 1, "time": "00:10:00"}
STEPS = 40


@pytest.fixture
def here(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _executor(**keys: Any) -> hpc_train.Executor:
    site = keys.pop("site", TWO_NODES["site"])
    return hpc_train.Executor(site=site, **{**{k: v for k, v in TWO_NODES.items() if k != "site"}, **keys})


def _train(steps: int, pause: float) -> dict[str, Any] | None:
    """A user's own loop: resumes from its checkpoint, saves and returns when asked to stop."""
    import time as clock

    import torch

    import hpc_train

    ctx = hpc_train.context()
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    state = {"model": model, "optimizer": optimizer}
    start = ctx.checkpoint.load(state) or 0
    for step in range(start + 1, steps + 1):
        loss = model(torch.full((8, 4), step / steps)).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        ctx.log(step, loss=loss.item())
        clock.sleep(pause)
        if ctx.should_stop():
            ctx.checkpoint.save(step, state)
            return None
    return {"weight": model.weight.detach().tolist(), "bias": model.bias.item(), "started_at": start,
            "world": ctx.world_size}


def _uninterrupted(steps: int) -> tuple[list[list[float]], float]:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(1, steps + 1):
        loss = model(torch.full((8, 4), step / steps)).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model.weight.detach().tolist(), model.bias.item()


def test_a_result_a_failure_and_an_array_of_three(here: Path) -> None:
    def world(offset: int) -> tuple[int, int, str]:
        ctx = hpc_train.context()
        return ctx.rank, ctx.world_size + offset, ctx.node_rank

    def fails() -> None:
        raise ValueError("bad value 7")

    executor = _executor()
    job = executor.submit(world, 10)
    assert job.result() == (0, 12, 0)
    assert job.state == "COMPLETED" and job.job_id.isdigit()
    failed = executor.submit(fails)
    with pytest.raises(hpc_train.JobFailed) as error:
        failed.result()
    assert error.value.failure_class == "user_error" and "bad value 7" in error.value.reason
    jobs = executor.map_array(lambda x: x * hpc_train.context().world_size, [1, 2, 3])
    assert len({one.job_id.split("_")[0] for one in jobs}) == 1  # one job array
    assert [one.result() for one in jobs] == [2, 4, 6]


def test_a_preempted_function_is_requeued_and_returns_the_uninterrupted_result(here: Path) -> None:
    job = _executor(sets=("retry.standby=false",)).submit(_train, STEPS, 0.1)  # it requeues, never restarts in place
    _wait_for_step(job.job_id, job.run_dir, 8)
    subprocess.run(["scancel", "--signal=USR2", job.job_id], check=True, timeout=30)
    result = job.result()
    outcomes = [a.outcome for a in job.attempts]
    assert outcomes[0] == "preempted" and outcomes[-1] == "completed" and job.attempts[0].requeued, job.attempts
    assert result is not None and result["started_at"] == job.attempts[0].end_step >= 8, result
    weight, bias = _uninterrupted(STEPS)
    assert result["weight"] == weight and result["bias"] == bias and result["world"] == 2


def test_hpc_train_cancel_ends_the_job_and_status_names_the_user(here: Path) -> None:
    job = _executor().submit(_train, 100_000, 0.1)
    _wait_for_step(job.job_id, job.run_dir, 3)
    done = subprocess.run([sys.executable, "-m", "hpc_train", "cancel", str(job.run_dir)], capture_output=True,
                          text=True, timeout=120, check=False)
    assert done.returncode == 0 and f"cancelled job {job.job_id}" in done.stdout, done.stdout + done.stderr
    with pytest.raises(hpc_train.JobFailed) as error:
        job.result()
    assert error.value.failure_class == "cancelled" and "by the user: hpc_train cancel" in error.value.reason
    assert job.state == "CANCELLED"
    again = subprocess.run([sys.executable, "-m", "hpc_train", "cancel", str(job.run_dir)], capture_output=True,
                           text=True, timeout=120, check=False)
    assert again.returncode == 2 and "has no job queued or running" in again.stderr, again.stderr
    # and the API's own Job.cancel(), as a sweep script calls it
    other = _executor().submit(_train, 100_000, 0.1)
    _wait_for_step(other.job_id, other.run_dir, 3)
    other.cancel()
    with pytest.raises(hpc_train.JobFailed) as error:
        other.result()
    assert error.value.failure_class == "cancelled" and "by the user: Job.cancel()" in error.value.reason
    other.cancel()  # an ended job: nothing to do, as submitit's


def test_hpc_train_run_launches_an_unmodified_script_on_two_nodes_from_one_line(here: Path) -> None:
    script = str(Path(__file__).resolve().parents[2] / "examples" / "ddp_script" / "train_cnn.py")
    result = subprocess.run([sys.executable, "-m", "hpc_train", "run", "--site", "local-slurm", "--nodes", "2",
                             "--tasks-per-node", "1", "--cpus-per-task", "1", "--time", "00:10:00", script,
                             "--epochs", "1"], cwd=here, capture_output=True, text=True, timeout=400, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "epoch 0: mean loss" in result.stdout and "COMPLETED" in result.stdout, result.stdout
    assert (here / "runs" / "train_cnn" / "attempts.jsonl").exists()
