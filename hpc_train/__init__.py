"""hpc_train: distributed DeepSpeed training on Slurm, from a login node in one command.

The login-node side (config, plan, render, submit) never imports torch or deepspeed; ``import hpc_train``
neither. On a login node, :class:`Executor` submits a function to every rank of a job
(``hpc_train.Executor(nodes=2).submit(fn, *args).result()``); on a rank running your own program,
:func:`context` returns its run context.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hpc_train._moved import install as _keep_old_import_paths

if TYPE_CHECKING:
    from hpc_train.login.api import Executor, Job, JobFailed
    from hpc_train.rank.program.context import RunContext

__all__ = ["Executor", "Job", "JobFailed", "__version__", "context"]
_API = ("Executor", "Job", "JobFailed")
__version__ = "0.1.0"
_keep_old_import_paths()


def context() -> RunContext:
    """This rank's run context (``ctx`` of a function; in a script, the first call starts or joins the default
    process group). Works on ranks hpc_train started with ``job.program`` set to a function or a script."""
    from hpc_train.rank.program.context import context as rank_context  # torch only now, on a rank

    return rank_context()


def __getattr__(name: str) -> object:
    """``hpc_train.Executor``, ``Job`` and ``JobFailed``, imported when first named: ``import hpc_train`` on a rank
    stays as light as it was."""
    if name in _API:
        from hpc_train.login import api

        return getattr(api, name)
    raise AttributeError(f"module 'hpc_train' has no attribute {name!r}")
