"""``[job] program``: the built-in ``train`` or ``smoke``, a function every rank calls, or a script every rank runs.

Three forms besides the built-ins: ``"package.module:function"``, ``"path/to/file.py:function"`` and
``"path/to/script.py"``. They are read here without importing anything of the user's: on the login node a
malformed entry point or a missing file is refused before anything is written, and the plan records the
file paths absolute (relative ones are taken from the config file's folder, which every rank also puts on
``sys.path``). Whether the module imports and the function takes ``ctx`` is found on the ranks.
"""

from __future__ import annotations

import importlib.machinery
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from hpc_train.errors import ConfigError

__all__ = ["BUILTIN_PROGRAMS", "Program", "check_program", "parse_program", "resolve_program"]

BUILTIN_PROGRAMS = ("train", "smoke")
_FORMS = ('"train", "smoke", "package.module:function", "path/to/file.py:function" or "path/to/script.py"')
Kind = Literal["train", "smoke", "module", "file", "script"]


@dataclass(frozen=True)
class Program:
    """One ``job.program`` value taken apart: ``module`` for the module form, ``path`` for a file or script,
    ``function`` for both function forms."""

    kind: Kind
    module: str = ""
    path: str = ""
    function: str = ""

    @property
    def is_user_code(self) -> bool:
        return self.kind not in BUILTIN_PROGRAMS

    def text(self) -> str:
        """The value as ``job.program`` writes it."""
        if self.kind in BUILTIN_PROGRAMS:
            return self.kind
        if self.kind == "script":
            return self.path
        return f"{self.module or self.path}:{self.function}"


def _problem(value: str) -> tuple[str, str] | None:
    """Why ``value`` is not a program (problem, fix), or None."""
    if any(ord(ch) < 32 or ord(ch) == 127 for ch in value):
        return f"{value!r} has a control character", "write the entry point on one line"
    if value in BUILTIN_PROGRAMS:
        return None
    if value.count(":") > 1:
        return f'"{value}" has more than one ":"', f"write {_FORMS}"
    target, colon, function = value.partition(":")
    if colon:
        if not target or not function:
            side = "module or file" if not target else "function"
            return f'"{value}" names no {side}', 'write "package.module:function" or "path/to/file.py:function"'
        if not function.isidentifier():
            return f'"{function}" in "{value}" is not a Python name', "name a function defined at the module's top"
        if not target.endswith(".py") and "/" not in target:
            bad = [part for part in target.split(".") if not part.isidentifier()]
            if bad:
                return (f'"{target}" in "{value}" is not a module name ("{bad[0]}")',
                        "write a dotted module name (package.module), or a path ending in .py")
        return None
    if value.endswith(".py"):
        return None
    return f'"{value}" is not a program', f"write {_FORMS}"


def check_program(value: str) -> tuple[str, str] | None:
    """The per-value check of ``job.program`` (syntax only: files are looked for by :func:`resolve_program`)."""
    return _problem(value)


def parse_program(value: str) -> Program:
    """``value`` taken apart; ConfigError naming ``job.program`` when it is malformed."""
    bad = _problem(value)
    if bad:
        raise ConfigError("job.program", *bad)
    if value in BUILTIN_PROGRAMS:
        return Program(value)  # type: ignore[arg-type]
    target, colon, function = value.partition(":")
    if not colon:
        return Program("script", path=value)
    if target.endswith(".py") or "/" in target:
        return Program("file", path=target, function=function)
    return Program("module", module=target, function=function)


def _under(parts: list[str], roots: list[str]) -> str | None:
    """The file of the module ``parts`` inside one of ``roots``, or None."""
    for root in roots:
        base = Path(root, *parts)
        for candidate in (base.with_suffix(".py"), base / "__init__.py"):
            if candidate.is_file():
                return str(candidate)
    return None


def _find_module(module: str, config_dir: str) -> str | None:
    """Where dotted ``module`` is, in the config file's folder or this Python's packages, found without
    importing anything (a package's ``__init__`` would run user code on the login node); None when nowhere."""
    parts = module.split(".")
    found = _under(parts, [config_dir])
    if found or parts[0] in sys.builtin_module_names:
        return found or module
    spec = importlib.machinery.PathFinder.find_spec(parts[0], [entry for entry in sys.path if entry])
    if spec is None:
        return None
    if len(parts) == 1:
        return spec.origin or module
    return _under(parts[1:], list(spec.submodule_search_locations or []))


def resolve_program(value: str, config_dir: Path) -> str:
    """``value`` with its file made absolute (relative to ``config_dir``), after checking that the file or
    module exists; ConfigError naming ``job.program``, the value and the fix otherwise."""
    program = parse_program(value)
    if not program.is_user_code:
        return value
    if program.kind == "module":
        if _find_module(program.module, str(config_dir)) is None:
            raise ConfigError("job.program", f'module "{program.module}" of "{value}" is found neither in the config '
                              f"file's folder {config_dir} nor in this Python's packages",
                              "check the spelling, install the package, or give the file: path/to/file.py:function")
        return value
    path = Path(os.path.normpath(config_dir / program.path))
    if not path.is_file():
        what = "script" if program.kind == "script" else "file"
        raise ConfigError("job.program", f"{what} {path} of \"{value}\" does not exist"
                          + (" (it is a folder)" if path.is_dir() else ""),
                          f"check the path; a relative path is taken from the config file's folder {config_dir}")
    absolute = Program(program.kind, path=str(path), function=program.function)
    return absolute.text()
