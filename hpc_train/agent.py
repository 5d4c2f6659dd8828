"""``python -m hpc_train.agent RUN_DIR``: a node's agent (and ``--settle``), the name the srun template types,
kept as the door to :mod:`hpc_train.rank.agent.agent` so that scripts rendered before keep working."""

from __future__ import annotations

import sys

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    from hpc_train.rank.agent.agent import main as agent_main

    return agent_main(argv)


if __name__ == "__main__":
    sys.exit(main())
