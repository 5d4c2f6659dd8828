"""Entry points into the user's code: ``[job] program``, ``[train] model``, ``[data] source`` and ``collate``.

``job.program`` is the built-in ``train`` or ``smoke``, a function every rank calls, or a script every rank
runs: ``"package.module:function"``, ``"path/to/file.py:function"`` or ``"path/to/script.py"``. The other keys
take a built-in name or one of the two function forms (a model factory, a dataset, a collate function). One
resolver serves them all, without importing anything of the user's: on the login node a malformed entry point
or a missing file is refused before anything is written, and the plan records the file paths absolute
(relative ones are taken from the config file's folder, which every rank also puts on ``sys.path``). Whether
the module imports and the function takes its arguments is found on the ranks.
"""

from __future__ import annotations

import importlib.util
import os
import stat
import sys
from dataclasses import dataclass
from pathlib import Path

from hpc_train.errors import ConfigError, did_you_mean

__all__ = ["API_PROGRAM", "BUILTIN_PROGRAMS", "Program", "check_entry_point", "check_program", "parse_entry_point",
           "parse_program", "resolve_entry_point", "resolve_program"]

BUILTIN_PROGRAMS = ("train", "smoke")
API_PROGRAM = "hpc_train.rank.program.pickled:call"  # job.program of hpc_train.Executor.submit's functions
_FORMS = ('"train", "smoke", "package.module:function", "path/to/file.py:function" or "path/to/script.py"')
_FUNCTION_FORMS = '"package.module:function" or "path/to/file.py:function"'
# "module", "file" and "script" are the user's code; any other kind is a built-in name ("train", "tiny", ...).
Kind = str


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
        return self.kind in ("module", "file", "script")

    def text(self) -> str:
        """The value as ``job.program`` writes it."""
        if not self.is_user_code:
            return self.kind
        if self.kind == "script":
            return self.path
        return f"{self.module or self.path}:{self.function}"


def _problem(value: str, builtins: tuple[str, ...] = BUILTIN_PROGRAMS, scripts: bool = True,
             what: str = "a program") -> tuple[str, str] | None:
    """Why ``value`` is not one of ``builtins`` nor an entry point (problem, fix), or None; ``scripts``: whether
    a bare ``path/to/script.py`` is a form; ``what`` names the built-ins in the message."""
    forms = _FORMS if scripts else ", ".join(f'"{name}"' for name in builtins) + f", {_FUNCTION_FORMS}"
    if any(ord(ch) < 32 or ord(ch) == 127 for ch in value):
        return f"{value!r} has a control character", "write the entry point on one line"
    if value in builtins:
        return None
    if value.count(":") > 1:
        return f'"{value}" has more than one ":"', f"write {forms}"
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
    if value.endswith(".py") and scripts:
        return None
    if value.endswith(".py"):
        return f'"{value}" names no function', f'write "{value}:function"'
    hint = did_you_mean(value, [name for name in builtins if name])
    return f'"{value}" is not {what}' + (f", {hint}" if hint else ""), f"write {forms}"


def check_program(value: str) -> tuple[str, str] | None:
    """The per-value check of ``job.program`` (syntax only: files are looked for by :func:`resolve_program`)."""
    return _problem(value)


def check_entry_point(value: str, builtins: tuple[str, ...], what: str = "a known name") -> tuple[str, str] | None:
    """The per-value check of a key that takes one of ``builtins`` (``what`` they are) or a function's entry
    point."""
    return _problem(value, builtins, scripts=False, what=what)


def parse_entry_point(key: str, value: str, builtins: tuple[str, ...] = ()) -> Program:
    """A function's entry point (``kind`` module or file), or ``Program(value)`` for one of ``builtins``;
    ConfigError naming ``key`` when it is malformed."""
    bad = _problem(value, builtins, scripts=False)
    if bad:
        raise ConfigError(key, *bad)
    if value in builtins:
        return Program(value)
    return _function_form(value)


def _function_form(value: str) -> Program:
    target, _, function = value.partition(":")
    if target.endswith(".py") or "/" in target:
        return Program("file", path=target, function=function)
    return Program("module", module=target, function=function)


def parse_program(value: str) -> Program:
    """``value`` taken apart; ConfigError naming ``job.program`` when it is malformed."""
    bad = _problem(value)
    if bad:
        raise ConfigError("job.program", *bad)
    if value in BUILTIN_PROGRAMS:
        return Program(value)
    if ":" not in value:
        return Program("script", path=value)
    return _function_form(value)


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
    try:  # every finder of this Python (an editable install's too); a top-level name imports nothing to be found
        spec = importlib.util.find_spec(parts[0])
    except (ImportError, ValueError):
        spec = None
    if spec is None:
        return None
    if len(parts) == 1:
        return spec.origin or module
    return _under(parts[1:], list(spec.submodule_search_locations or []))


def resolve_program(value: str, config_dir: Path) -> str:
    """``value`` with its file made absolute (relative to ``config_dir``), after checking that the file or
    module exists; ConfigError naming ``job.program``, the value and the fix otherwise."""
    return _resolved("job.program", parse_program(value), value, config_dir)


def resolve_entry_point(key: str, value: str, config_dir: Path, builtins: tuple[str, ...] = ()) -> str:
    """As :func:`resolve_program`, for ``key`` taking one of ``builtins`` or a function's entry point."""
    return _resolved(key, parse_entry_point(key, value, builtins), value, config_dir)


def _file_kind(path: Path) -> str:
    """What stands at ``path`` when it is not a regular file ("" when nothing does): a FIFO or a device would
    block or stream forever where Python reads a program."""
    try:
        mode = path.stat().st_mode
    except OSError:
        return ""
    kinds = [(stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a named pipe (FIFO)"), (stat.S_ISCHR, "a character device"),
             (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket")]
    return next((name for test, name in kinds if test(mode)), "not a regular file")


def _resolved(key: str, program: Program, value: str, config_dir: Path) -> str:
    if not program.is_user_code:
        return value
    if program.kind == "module":
        if _find_module(program.module, str(config_dir)) is None:
            raise ConfigError(key, f'module "{program.module}" of "{value}" is found neither in the config '
                              f"file's folder {config_dir} nor in this Python's packages",
                              "check the spelling, install the package, or give the file: path/to/file.py:function")
        return value
    path = Path(os.path.normpath(config_dir / program.path))
    if not path.is_file():
        what = "script" if program.kind == "script" else "file"
        kind = _file_kind(path)
        raise ConfigError(key, f"{what} {path} of \"{value}\" " + (f"is {kind}, not a file" if kind else
                                                                   "does not exist"),
                          f"check the path; a relative path is taken from the config file's folder {config_dir}"
                          if not kind else "give a Python file (path/to/train.py)")
    absolute = Program(program.kind, path=str(path), function=program.function)
    return absolute.text()
