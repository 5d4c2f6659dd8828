"""The Python API's two pickles in a run folder: the function with its arguments (written on the login node, read
by every rank) and rank 0's return value (written by rank 0 when the attempt completes, read by ``Job.result()``).

Why pickles: ``Executor.submit(fn, *args)`` takes any callable, as submitit does, a lambda or a notebook's
function included, so it travels by value (cloudpickle, which submitit itself uses). A pickle runs code when it
is loaded, so each is read only from a run folder that is the user's own and private (the same guard submitit's
job script runs before its ranks unpickle), never through a link, and within a size bound.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpc_train.errors import ConfigError
from hpc_train.run.files import atomic_write, open_record
from hpc_train.run.paths import FUNCTION_FILE, VALUE_FILE

__all__ = ["Call", "ReturnedValue", "read_call", "read_value", "write_call", "write_value"]

MAX_PICKLE = 1 << 30  # a function with its arguments, or a return value, larger than 1 GiB belongs in a file


@dataclass(frozen=True)
class Call:
    """What every rank calls: ``function(*args, **kwargs)``."""

    function: Any
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] | None = None


@dataclass(frozen=True)
class ReturnedValue:
    """Rank 0's return value, or why it could not be kept (``problem``: it did not pickle)."""

    value: Any = None
    problem: str = ""


def _dumps(obj: Any) -> bytes:
    import cloudpickle  # submitit's own dependency: there wherever submitit is

    return cloudpickle.dumps(obj)


def write_call(run_dir: Path, call: Call) -> None:
    """Pickle the call into ``run_dir``; ConfigError naming what did not pickle (nothing is submitted then)."""
    try:
        data = _dumps(call)
    except Exception as error:  # cloudpickle raises what the object's __reduce__ raises
        raise ConfigError("Executor.submit", f"cannot pickle {_name(call.function)} with its arguments "
                          f"({type(error).__name__}: {error})", "pass values that pickle (no open files, locks or "
                          "sockets); open such things inside the function") from None
    if len(data) > MAX_PICKLE:
        raise ConfigError("Executor.submit", f"{_name(call.function)} with its arguments pickles to "
                          f"{len(data) / 2**30:.1f} GiB", "pass a path and read large data inside the function")
    atomic_write(Path(run_dir) / FUNCTION_FILE, data)


def write_value(run_dir: Path, value: Any) -> ReturnedValue:
    """Keep rank 0's return value; a value that does not pickle is kept as the reason (``Job.result()`` raises)."""
    kept = ReturnedValue(value)
    try:
        data = _dumps(kept)
    except Exception as error:
        kept = ReturnedValue(None, f"the return value ({type(value).__name__}) does not pickle: "
                                   f"{type(error).__name__}: {error}")
        data = _dumps(kept)
    if len(data) > MAX_PICKLE:
        kept = ReturnedValue(None, f"the return value pickles to {len(data) / 2**30:.1f} GiB, more than the "
                                   f"{MAX_PICKLE >> 30} GiB kept; write it to a file and return the path")
        data = _dumps(kept)
    atomic_write(Path(run_dir) / VALUE_FILE, data)
    return kept


def _load(path: Path) -> Any:
    """Unpickle a run-folder file that is a regular file of ours, not a link, writable by nobody else."""
    import pickle

    with open_record(path) as handle:
        info = os.fstat(handle.fileno())
        if info.st_uid != os.getuid() or info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            raise PermissionError(f"{path} is not this user's private file (mode {stat.filemode(info.st_mode)}, "
                                  f"owner {info.st_uid}): it is not unpickled")
        data = handle.read(MAX_PICKLE + 1)
    if len(data) > MAX_PICKLE:
        raise ValueError(f"{path} is larger than {MAX_PICKLE >> 30} GiB")
    return pickle.loads(data)  # noqa: S301 - the user's own private file, checked above


def read_call(run_dir: Path) -> Call:
    """The call every rank makes; OSError or PermissionError when the file is missing or not the user's."""
    call = _load(Path(run_dir) / FUNCTION_FILE)
    if not isinstance(call, Call):
        raise ValueError(f"{Path(run_dir) / FUNCTION_FILE} does not hold a call ({type(call).__name__})")
    return call


def read_value(run_dir: Path) -> ReturnedValue:
    """Rank 0's kept return value (OSError when there is none)."""
    kept = _load(Path(run_dir) / VALUE_FILE)
    if not isinstance(kept, ReturnedValue):
        raise ValueError(f"{Path(run_dir) / VALUE_FILE} does not hold a return value ({type(kept).__name__})")
    return kept


def _name(function: Any) -> str:
    return getattr(function, "__qualname__", None) or type(function).__name__
