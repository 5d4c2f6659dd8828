"""``job.program`` of ``hpc_train.Executor.submit``: every rank calls the pickled function with its arguments.

The function asks for its context with ``hpc_train.context()``, as a script does; what it returns on rank 0 is
kept in the run folder by the runner when the attempt completes (:mod:`hpc_train.run.pickled`).
"""

from __future__ import annotations

from typing import Any

from hpc_train.rank.runtime.entry_points import UserCodeError
from hpc_train.run.pickled import read_call

__all__ = ["call"]


def call(ctx: Any) -> Any:
    """Load the call from the run folder and make it; a call that cannot be loaded is the user's error, named."""
    try:
        made = read_call(ctx.run_dir)
    except (OSError, ValueError) as error:
        raise UserCodeError(f"the submitted function cannot be loaded from {ctx.run_dir} "
                            f"({type(error).__name__}: {error})") from None
    except Exception as error:  # unpickling imports the function's module: a module missing on the nodes
        raise UserCodeError(f"the submitted function cannot be unpickled on this node ({type(error).__name__}: "
                            f"{error}); its module must be importable here, as for submitit") from None
    return made.function(*made.args, **(made.kwargs or {}))
