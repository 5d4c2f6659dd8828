"""``python -m hpc_train.submit CONFIG --site SITE``: the same as ``hpc_train submit``; the door to
:mod:`hpc_train.login.submit`."""

from __future__ import annotations

import sys

from hpc_train.login.submit import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
