"""``python -m hpc_train COMMAND``: the ``hpc_train`` command; the door to :mod:`hpc_train.login.main`."""

from __future__ import annotations

import sys

from hpc_train.login.main import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
