"""``hpc_train.Executor`` and ``Job``: misuse is refused before anything is written, naming the fix; on the local
executor with real ranks, a function's result is rank 0's return value, a failure is ``JobFailed`` with the class
``status`` gives it, an array runs one job per item, and a cancel ends the ranks and is recorded as the user's."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import hpc_train
from hpc_train.config.program import API_PROGRAM
from hpc_train.errors import ConfigError
from hpc_train.login.api.executor import job_overrides

LOCAL = {"tasks_per_node": 2, "time": "00:10:00"}


@pytest.fixture
def here(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)  # run folders go under ./runs, as the command's do
    return tmp_path


def test_job_keys_are_typed_like_the_file_and_a_misspelt_one_names_the_nearest() -> None:
    assert job_overrides({"nodes": 2, "time": "01:00:00", "args": ["--x", "1"], "forward_env": []}) == [
        "job.nodes=2", "job.time=01:00:00", 'job.args=["--x", "1"]', "job.forward_env=[]"]
    assert job_overrides({"name": "x", "spare_nodes": 0})[1] == "job.spare_nodes=0"
    with pytest.raises(ConfigError, match=r'"tasks_pernode" is not a key of \[job\], did you mean') as error:
        hpc_train.Executor(tasks_pernode=2)
    assert "tasks_per_node" in str(error.value) and "sets=(" in str(error.value)
    with pytest.raises(ConfigError, match=r"Executor\(program=\.\.\.\)"):
        hpc_train.Executor(program="train")  # the program is the submitted function
    with pytest.raises(ConfigError, match="use one of auto, slurm, local"):
        hpc_train.Executor(executor="slurmm")
    with pytest.raises(ConfigError, match="one string, not a sequence"):
        hpc_train.Executor(sets="train.lr=1e-3")
    with pytest.raises(ConfigError, match="give a string, a number"):
        hpc_train.Executor(nodes={"two": 2})


def test_the_plan_is_the_command_line_s_with_the_function_as_program(here: Path) -> None:
    (here / "job.toml").write_text('[job]\nname = "mine"\nnodes = 1\n[train]\nlr = 0.5\n')
    executor = hpc_train.Executor("job.toml", sets=("train.steps=70",), tasks_per_node=2)
    plan = executor.plan()
    assert plan.config.job.program == API_PROGRAM and plan.config.job.tasks_per_node == 2
    assert plan.config.train.lr == 0.5 and plan.config.train.steps == 70 and plan.name == "mine"
    assert plan.run_dir == str(here / "runs" / "mine") and plan.executor == "local"
    with pytest.raises(ConfigError, match=r"job\.nodes"):
        hpc_train.Executor(nodes=0).plan()  # validated as the command validates


def test_misuse_at_submit_writes_nothing(here: Path) -> None:
    executor = hpc_train.Executor(**LOCAL)
    with pytest.raises(ConfigError, match=r"is not callable.*not executor\.submit\(train\(arg\)\)"):
        executor.submit(42)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="cannot pickle"):
        executor.submit(print, threading.Lock())
    assert not (here / "runs").exists() or not any((here / "runs").iterdir())


def test_importing_the_api_imports_no_torch() -> None:
    code = ("import sys, hpc_train; hpc_train.Executor, hpc_train.Job, hpc_train.JobFailed; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "False", out.stderr


@pytest.mark.slow
def test_a_function_s_result_its_failure_and_an_array_on_the_local_executor(here: Path) -> None:
    def add(a: int, b: int = 0) -> dict[str, object]:
        import os

        ctx = hpc_train.context()
        return {"sum": a + b, "rank": ctx.rank, "world": ctx.world_size, "env": os.environ["HPC_TRAIN_RUN_DIR"]}

    def fails() -> None:
        raise ValueError("bad value 7")

    executor = hpc_train.Executor(**LOCAL)
    job = executor.submit(add, 2, b=3)
    assert job.result() == {"sum": 5, "rank": 0, "world": 2, "env": str(job.run_dir)}  # rank 0's return value
    assert job.done() and job.state == "COMPLETED" and [a.outcome for a in job.attempts] == ["completed"]
    assert job.run_dir.parent == here / "runs" and job.run_dir.name.startswith("add-")  # a new run per submit
    failed = executor.submit(fails)
    with pytest.raises(hpc_train.JobFailed) as error:
        failed.result()
    assert error.value.failure_class == "user_error" and "ValueError('bad value 7')" in error.value.reason
    assert str(failed.run_dir) in str(error.value)
    jobs = executor.map_array(lambda x, y: x * y, [1, 2, 3], [4, 5, 6])  # "<lambda>": named "lambda-..."
    assert [one.result() for one in jobs] == [4, 10, 18]
    assert [one.run_dir.name[-3:] for one in jobs] == ["000", "001", "002"]
    assert jobs[0].run_dir.name.startswith("lambda-")


@pytest.mark.slow
def test_a_cancel_ends_the_ranks_and_a_value_that_does_not_pickle_is_named(here: Path) -> None:
    def forever() -> None:
        ctx = hpc_train.context()
        for step in range(1, 100_000):
            time.sleep(0.05)
            ctx.log(step, loss=1.0)

    def a_lock() -> object:
        return threading.Lock()

    executor = hpc_train.Executor(**LOCAL)
    job = executor.submit(forever)
    deadline = time.monotonic() + 120
    while not (job.run_dir / "metrics.jsonl").exists():
        assert time.monotonic() < deadline and not job.done(), job.state
        time.sleep(0.2)
    job.cancel()
    with pytest.raises(hpc_train.JobFailed) as error:
        job.result()
    assert error.value.failure_class == "cancelled" and "by the user: Job.cancel()" in error.value.reason
    assert [a.outcome for a in job.attempts] == ["cancelled"]
    ranks = subprocess.run(["pgrep", "-f", str(job.run_dir)], capture_output=True, text=True, check=False).stdout
    assert not ranks.strip(), ranks  # the controller and both ranks are gone
    with pytest.raises(hpc_train.JobFailed, match="does not pickle") as error:
        executor.submit(a_lock).result()
    assert error.value.failure_class == "no_result"
