"""Load a function the user named in the config (``job.program``, ``train.model``, ``data.source``,
``data.collate``) on a rank, and say in one line what went wrong when it cannot be used.

The login node checked the syntax and that the file or module exists (:mod:`hpc_train.config.program`); here
it is imported, and the function is checked to take the arguments hpc_train will pass, before any of them is
built: a typo in a factory's name fails at once with the names the module does have.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hpc_train.config.program import Program

__all__ = ["UserCodeError", "load_callable"]


class UserCodeError(RuntimeError):
    """The user's code could not start, or gave hpc_train something it cannot use: the message is the one
    line that says which. ``user_cause`` is the user's own exception (an import error, a factory that raised),
    whose traceback is the one worth showing."""

    def __init__(self, message: str, user_cause: BaseException | None = None) -> None:
        super().__init__(message)
        self.user_cause = user_cause


def _module_of(program: Program) -> Any:
    if program.kind == "module":
        return importlib.import_module(program.module)
    name = Path(program.path).stem
    loaded = sys.modules.get(name)
    if loaded is not None and getattr(loaded, "__file__", None) == program.path:
        return loaded  # the same file named by two keys (model and data): one module, one set of classes
    if loaded is not None:  # a file named like a module already loaded (json.py): keep both
        name = f"hpc_train_user_{name}"
        if getattr(sys.modules.get(name), "__file__", None) == program.path:
            return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, program.path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {program.path} as a module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # pickling the program's own classes (DataLoader workers) finds them
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def load_callable(key: str, program: Program, arguments: tuple[str, ...]) -> Callable[..., Any]:
    """The function ``program`` names, checked to take ``arguments`` (their names, for the message);
    UserCodeError naming ``key`` and the entry point otherwise."""
    where, said = program.module or program.path, f"{key} {program.text()}"
    try:
        module = _module_of(program)
    except Exception as error:
        raise UserCodeError(f"{said}: importing {where} failed: {type(error).__name__}: {error}", error) from error
    function = getattr(module, program.function, None)
    if function is None or not callable(function):
        names = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_")
                       and getattr(v, "__module__", None) == module.__name__)
        raise UserCodeError(f"{said}: {where} has no function {program.function}"
                            + (f" (it has: {', '.join(names[:10])})" if names else ""))
    try:
        inspect.signature(function).bind(*(object() for _ in arguments))
    except TypeError:
        wanted = ", ".join(arguments)
        what = "the run context" if arguments == ("ctx",) else f"({wanted})"
        raise UserCodeError(f"{said}: {program.function}{inspect.signature(function)} does not take {what}: "
                            f"define it as def {program.function}({wanted})") from None
    except ValueError:  # no signature to inspect (a builtin): let the call say
        pass
    return function
