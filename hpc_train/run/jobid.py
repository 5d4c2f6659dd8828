"""The name ``scontrol`` acts on for this job alone.

A task of a job array has its own ``SLURM_JOB_ID``, but one task's id is also the array's own id, and
``scontrol requeue ARRAY_ID`` requeues every task of the array (submitit and Lightning users meet this as
"requeue of job-array tasks breaks"). ``ARRAYID_TASKID`` always names one task.
"""

from __future__ import annotations

from collections.abc import Mapping

__all__ = ["scontrol_job_id"]


def scontrol_job_id(env: Mapping[str, str], job_id: str | None = None) -> str:
    """``SLURM_ARRAY_JOB_ID_SLURM_ARRAY_TASK_ID`` for an array task, else ``SLURM_JOB_ID``. With ``job_id``
    (another job's id, read from a run folder): that id as it is unless it is this process's own job."""
    own = env.get("SLURM_JOB_ID", "")
    if job_id is not None and job_id != own:
        return job_id
    array, task = env.get("SLURM_ARRAY_JOB_ID", ""), env.get("SLURM_ARRAY_TASK_ID", "")
    return f"{array}_{task}" if array and task else own
