"""hpc_train: distributed DeepSpeed training on Slurm, from a login node in one command.

The login-node side (config, plan, render, submit) never imports torch or deepspeed; ``import hpc_train``
neither. On a rank running your own program, :func:`context` returns its run context.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hpc_train._moved import install as _keep_old_import_paths

if TYPE_CHECKING:
    from hpc_train.rank.program.context import RunContext

__all__ = ["__version__", "context"]
__version__ = "0.1.0"
_keep_old_import_paths()


def context() -> RunContext:
    """This rank's run context (``ctx`` of a function; in a script, the first call starts or joins the default
    process group). Works on ranks hpc_train started with ``job.program`` set to a function or a script."""
    from hpc_train.rank.program.context import context as rank_context  # torch only now, on a rank

    return rank_context()
