"""A failure's traceback as its author wants to read it: starting at the first frame of their own code.

Every error of a user's program passes through 4-7 frames of hpc_train's rank entry and runner (and ``runpy``'s
for a script) before it reaches the user's function. Those frames say nothing about the error; the traceback
keeps everything from the first frame outside them on, including any of ours the user's code called into, and
one line says how many were left out. A failure with no frame of the user's (the trainer's own) keeps all of it.
"""

from __future__ import annotations

import runpy
import traceback
from pathlib import Path
from types import TracebackType

__all__ = ["user_traceback"]

_PACKAGE = str(Path(__file__).resolve().parents[2]) + "/"
_RUNPY = ("<frozen runpy>", str(Path(runpy.__file__ or "runpy.py").resolve()))  # frozen since Python 3.11


def _is_ours(tb: TracebackType) -> bool:
    filename = tb.tb_frame.f_code.co_filename
    return filename in _RUNPY or str(Path(filename).resolve()).startswith(_PACKAGE)


def user_traceback(error: BaseException) -> str:
    """``traceback.format_exception(error)`` from the first frame that is not hpc_train's or runpy's."""
    tb, skipped = error.__traceback__, 0
    while tb is not None and _is_ours(tb):
        tb, skipped = tb.tb_next, skipped + 1
    if tb is None or not skipped:
        return "".join(traceback.format_exception(error))
    text = "".join(traceback.format_exception(type(error), error, tb))
    plural = "s" if skipped > 1 else ""
    return f"({skipped} frame{plural} of hpc_train and runpy before your code left out)\n{text}"
