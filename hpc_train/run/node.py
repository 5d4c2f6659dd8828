"""The name a rank gives its node in every record of the run folder: Slurm's, where there is one."""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping

__all__ = ["node_name"]


def node_name(environ: Mapping[str, str] = os.environ) -> str:
    """Slurm's node name (what ``--exclude`` and sacct take, and what tells nodes apart where several share one
    host, as on the local cluster), else the host name."""
    return environ.get("SLURMD_NODENAME") or socket.gethostname()
