"""``python -m hpc_train.submit CONFIG --site SITE``: the same as ``hpc_train submit``; the door to
:mod:`hpc_train.login.submit`."""

from __future__ import annotations

import sys
from typing import Any

from hpc_train.login.submit import main

__all__ = ["main"]


def __getattr__(name: str) -> Any:
    """The rest of ``hpc_train.login.submit``, for code written against the old name."""
    import importlib

    return getattr(importlib.import_module("hpc_train.login.submit"), name)


if __name__ == "__main__":
    sys.exit(main())
