"""The Python API: ``hpc_train.Executor``, ``hpc_train.Job`` and ``hpc_train.JobFailed`` (login side, no torch)."""

from hpc_train.login.api.executor import Executor
from hpc_train.login.api.job import Job, JobFailed

__all__ = ["Executor", "Job", "JobFailed"]
