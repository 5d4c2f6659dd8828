"""A failure's traceback as its author wants to read it: starting at the first frame of their own code.

Every error of a user's program passes through 4-7 frames of hpc_train's rank entry and runner (and ``runpy``'s
for a script) before it reaches the user's function. Those frames say nothing about the error; the traceback
keeps everything from the first frame outside them on, including any of ours the user's code called into, and
one line says how many were left out. Where that first frame is Python's library or an installed package's (a
failure before the user's function ran, or the trainer's own through torch), all of it is kept.
"""

from __future__ import annotations

import runpy
import sysconfig
import traceback
from pathlib import Path
from types import TracebackType

__all__ = ["user_traceback"]

_PACKAGE = str(Path(__file__).resolve().parents[2]) + "/"
_RUNPY = ("<frozen runpy>", str(Path(runpy.__file__ or "runpy.py").resolve()))  # frozen since Python 3.11
_LIBRARIES = tuple(str(Path(path).resolve()) + "/" for path in {
    sysconfig.get_paths()[name] for name in ("stdlib", "platstdlib", "purelib", "platlib")})


def _is_ours(tb: TracebackType) -> bool:
    filename = tb.tb_frame.f_code.co_filename
    return filename in _RUNPY or str(Path(filename).resolve()).startswith(_PACKAGE)


def _is_library(tb: TracebackType) -> bool:
    """A frame of Python's own library or of an installed package (torch, DeepSpeed): not the user's code, which
    a failure before the user's function was called (the process group, the imports) reaches first."""
    filename = tb.tb_frame.f_code.co_filename
    return filename.startswith("<") or str(Path(filename).resolve()).startswith(_LIBRARIES)


def user_traceback(error: BaseException) -> str:
    """``traceback.format_exception(error)`` from the first frame that is not hpc_train's or runpy's, where that
    frame is the user's (not Python's library or an installed package's); otherwise all of it."""
    tb, skipped = error.__traceback__, 0
    while tb is not None and _is_ours(tb):
        tb, skipped = tb.tb_next, skipped + 1
    if tb is None or not skipped or _is_library(tb):
        return "".join(traceback.format_exception(error))
    text = "".join(traceback.format_exception(type(error), error, tb))
    plural = "s" if skipped > 1 else ""
    return f"({skipped} frame{plural} of hpc_train and runpy before your code left out)\n{text}"
