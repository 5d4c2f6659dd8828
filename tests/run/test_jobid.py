"""The job name scontrol requeues: one array task, never the whole array."""

from __future__ import annotations

from hpc_train.rank.runtime.preemption import decide_requeue
from hpc_train.run.jobid import scontrol_job_id

ARRAY_TASK = {"SLURM_JOB_ID": "171", "SLURM_ARRAY_JOB_ID": "171", "SLURM_ARRAY_TASK_ID": "1"}


def test_an_array_task_is_named_by_array_and_task() -> None:
    assert scontrol_job_id(ARRAY_TASK) == "171_1"  # "171" alone would requeue every task of array 171
    assert scontrol_job_id({"SLURM_JOB_ID": "42"}) == "42"
    assert scontrol_job_id(ARRAY_TASK, "171") == "171_1"  # this process's own job
    assert scontrol_job_id(ARRAY_TASK, "99") == "99"  # another job, from a run folder: as it is
    assert scontrol_job_id({}) == ""


def test_a_preempted_array_task_requeues_itself_only() -> None:
    decision = decide_requeue(ARRAY_TASK, True, 10, 0)
    assert (decision.action, decision.reason) == ("scontrol", "scontrol requeue 171_1")
