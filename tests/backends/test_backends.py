"""Which backend a process runs under, and what each one answers: its job id, its restart limit, how it starts
its next attempt. The calls to scontrol and sbatch themselves run in tests/rank/runtime/test_preemption.py (a scripted
scontrol on PATH), tests/failures/test_recovery.py and on the local cluster (tests/slurm/)."""

from __future__ import annotations

from pathlib import Path

import pytest

from hpc_train.backends import (
    EXECUTORS,
    LocalBackend,
    NoBackend,
    SlurmBackend,
    backend_of,
    executor_backend,
)
from hpc_train.run.chain import REQUEUE_ENV
from hpc_train.run.exit_codes import EXIT_STOPPED, LOCAL_REQUEUE_EXIT


@pytest.mark.parametrize(("env", "kind"), [
    ({}, NoBackend),
    ({"SLURM_JOB_ID": "42"}, SlurmBackend),
    ({"SUBMITIT_EXECUTOR": "local"}, LocalBackend),
    ({"SUBMITIT_EXECUTOR": "local", "SLURM_JOB_ID": "42"}, LocalBackend),  # the local executor inside salloc
    ({"SUBMITIT_EXECUTOR": "slurm", "SLURM_JOB_ID": "42"}, SlurmBackend),
])
def test_a_process_finds_its_backend_in_its_environment(env: dict[str, str], kind: type) -> None:
    assert type(backend_of(env)) is kind


def test_the_plan_names_a_backend_and_an_unknown_name_is_neither_slurm_nor_local() -> None:
    assert {"slurm": SlurmBackend, "local": LocalBackend} == EXECUTORS
    assert executor_backend("slurm").on_slurm and executor_backend("slurm").job_ids
    assert not executor_backend("local").on_slurm and not executor_backend("local").job_ids
    assert executor_backend("pbs") is NoBackend


def test_slurm_names_one_array_task_and_a_job_read_from_a_run_folder_as_it_is() -> None:
    task = {"SLURM_JOB_ID": "43", "SLURM_ARRAY_JOB_ID": "40", "SLURM_ARRAY_TASK_ID": "3"}
    assert SlurmBackend(task).job_id == "40_3"
    assert SlurmBackend(task, "77").job_id == "77" and SlurmBackend(task, "43").job_id == "40_3"
    assert NoBackend({}).job_id == ""


def test_each_backend_starts_its_next_attempt_its_own_way() -> None:
    assert SlurmBackend({"SLURM_JOB_ID": "42"}).next_attempt().action == "scontrol"
    chained = SlurmBackend({"SLURM_JOB_ID": "42", REQUEUE_ENV: "dependency"})
    assert chained.chained and chained.next_attempt().action == "dependency"
    array_task = SlurmBackend({"SLURM_JOB_ID": "42", REQUEUE_ENV: "dependency", "SLURM_ARRAY_TASK_ID": "1"})
    assert (array_task.next_attempt().action, array_task.next_attempt().exit_code) == ("none", EXIT_STOPPED)
    local = LocalBackend({}).next_attempt()
    assert (local.action, local.exit_code) == ("local", LOCAL_REQUEUE_EXIT)
    assert NoBackend({}).next_attempt().action == "none"


def test_the_local_executor_restarts_at_most_five_times_whatever_the_config_allows() -> None:
    assert LocalBackend({}).restart_limit(3) == (3, "preempt.max_requeues = 3")
    limit, why = LocalBackend({}).restart_limit(10)
    assert limit == 5 and "at most 5 times" in why
    assert SlurmBackend({}).restart_limit(10)[0] == 10


def test_carrying_out_a_decision_without_slurm_changes_nothing(tmp_path: Path) -> None:
    decision = LocalBackend({}).next_attempt()
    assert LocalBackend({}).requeue(decision, tmp_path) is decision
    chained = SlurmBackend({"SLURM_JOB_ID": "42", REQUEUE_ENV: "dependency"})
    refused = chained.requeue(chained.next_attempt(), None)
    assert refused.action == "none" and "no run folder" in refused.reason


def test_auto_is_slurm_on_a_site_with_slurm_and_local_elsewhere() -> None:
    from hpc_train.backends import default_executor

    assert executor_backend(default_executor(True)) is SlurmBackend
    assert executor_backend(default_executor(False)) is LocalBackend
