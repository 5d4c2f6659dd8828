"""``python -m hpc_train.agent RUN_DIR``: a node's agent (and ``--settle``), the name the srun template types,
kept as the door to :mod:`hpc_train.rank.agent.agent` so that scripts rendered before keep working."""

from __future__ import annotations

import sys
from typing import Any

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    from hpc_train.rank.agent.agent import main as agent_main

    return agent_main(argv)


def __getattr__(name: str) -> Any:
    """The rest of ``hpc_train.rank.agent.agent``, for code written against the old name."""
    import importlib

    return getattr(importlib.import_module("hpc_train.rank.agent.agent"), name)


if __name__ == "__main__":
    sys.exit(main())
