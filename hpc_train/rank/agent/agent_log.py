"""The node agent's log: its lines as its node's first rank's, or, with spares, as a node's own."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

from hpc_train.run.loglines import rank_log_format
from hpc_train.run.node_log import NodeLogHandler, node_log_name, node_log_path
from hpc_train.run.paths import LOGS_DIR

__all__ = ["agent_logger"]


def agent_logger(run_dir: Path, rank: int, per_node: int, slot: int | None = None) -> logging.Logger:
    """The agent's lines as rank ``rank``'s (its node's first rank) in its node's log (rank 0's also on stdout,
    the batch output), or with ``slot`` the lines of a node's agent in a job with spares, which may hold no rank
    in a life: ``nodeK`` lines in ``logs/agents-FIRST-LAST.log``."""
    name = f"hpc_train.agent{rank}" if slot is None else f"hpc_train.agent-node{slot}"
    logger = logging.getLogger(name)
    if not logger.handlers:
        logger.setLevel(logging.INFO)
        logger.propagate = False
        (run_dir / LOGS_DIR).mkdir(mode=0o700, exist_ok=True)
        if slot is None:
            path, line = node_log_path(run_dir, rank, per_node), rank_log_format(rank)
        else:
            name = node_log_name(slot * per_node, per_node).replace("ranks-", "agents-", 1)
            path, line = run_dir / LOGS_DIR / name, f"%(asctime)s node{slot} %(levelname)s %(message)s"
        handler = NodeLogHandler(path)
        handler.setFormatter(logging.Formatter(line))
        logger.addHandler(handler)
        if rank == 0 and slot is None:
            stream = logging.StreamHandler(sys.stdout)
            stream.setFormatter(logging.Formatter(rank_log_format(rank)))
            logger.addHandler(stream)
    return logger
