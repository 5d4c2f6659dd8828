"""What the bench says beside its numbers: which nodes the ranks ran on, and over which transport.

Why: a bandwidth figure means little without knowing whether it crossed InfiniBand, a socket fall-back or only
shared memory. On GPUs the bench asks NCCL for its own INFO log (into a file, so the table stays readable),
keeps the lines that name a transport from every rank and lets :func:`~.collectives.transport_from_nccl_log`
judge them. On CPU the group is gloo over TCP and there is no NCCL log: the report says exactly that, and never
claims or denies a fall-back it cannot see.

No torch here: every function works on plain strings, so the tests need no GPU.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping, MutableMapping
from pathlib import Path
from typing import Any

from hpc_train.bench.collectives import _VIA, _normalise_via, parse_nccl_log, transport_from_nccl_log
from hpc_train.run.node import node_name

__all__ = ["describe_hosts", "expects_ib", "gloo_transport", "nccl_transport", "node_name", "read_nccl_log",
           "request_nccl_log", "transport_lines"]

NCCL_LOG_NAME = "nccl.%p.log"  # NCCL replaces %p with the process id
_VERBOSE = ("INFO", "TRACE")  # NCCL_DEBUG levels that print the transport lines
_SHOWN_NODES = 4


def describe_hosts(hosts: list[str]) -> str:
    """``2 nodes (n1, n2)``: distinct nodes in rank order, the first few named so a big job stays one line."""
    nodes = list(dict.fromkeys(hosts))
    named = ", ".join(nodes[:_SHOWN_NODES]) + (f", ... {len(nodes) - _SHOWN_NODES} more"
                                                if len(nodes) > _SHOWN_NODES else "")
    return f"{len(nodes)} node{'s' if len(nodes) != 1 else ''} ({named})"


# ------------------------------------------------------------------------------------------- NCCL's log


def request_nccl_log(environ: MutableMapping[str, str], directory: str) -> str:
    """Make NCCL write its INFO log to a file the bench can read; the file pattern (``%h``/``%p`` in it).

    Must run before the first NCCL call of the process. A user's NCCL_DEBUG_FILE is kept (the bench reads it
    there); a quieter NCCL_DEBUG than INFO is raised to INFO for this process, because only INFO names the
    transports.
    """
    if environ.get("NCCL_DEBUG", "").upper() not in _VERBOSE:
        environ["NCCL_DEBUG"] = "INFO"
    if not environ.get("NCCL_DEBUG_FILE"):
        environ["NCCL_DEBUG_FILE"] = str(Path(directory) / NCCL_LOG_NAME)
    return environ["NCCL_DEBUG_FILE"]


def read_nccl_log(pattern: str, host: str | None = None, pid: int | None = None) -> str:
    """This process's NCCL log, ``%h`` and ``%p`` expanded as NCCL does; '' when NCCL wrote none."""
    short_host = (host or socket.gethostname()).split(".")[0]
    path = Path(pattern.replace("%h", short_host).replace("%p", str(pid if pid is not None else os.getpid())))
    try:
        return path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ""


def transport_lines(text: str) -> list[str]:
    """The lines of an NCCL log that matter to the transport report: every ``NET/`` line without a channel,
    and one channel line per distinct transport, so gathering them from thousands of ranks stays small."""
    kept: list[str] = []
    seen: set[str] = set()
    for line in text.splitlines():
        via = _VIA.search(line)
        if via:
            name = _normalise_via(via[1])
            if name not in seen:
                seen.add(name)
                kept.append(line)
        elif "NET/" in line and line not in kept:
            kept.append(line)
    return kept


def expects_ib(environ: Mapping[str, str] = os.environ) -> bool:
    """InfiniBand (or RoCE) is expected when this node has an active RDMA port and NCCL_IB_DISABLE is not 1."""
    if environ.get("NCCL_IB_DISABLE", "0").strip() == "1":
        return False
    from hpc_train.fabric.sysfs import read_fabric

    return bool(read_fabric(environ.get("HPC_TRAIN_SYSFS", "/sys")).active_ib_ports())


def nccl_transport(rank_lines: list[list[str]], expect_ib: bool,
                   environ: Mapping[str, str] = os.environ) -> dict[str, Any]:
    """The report for an NCCL group from every rank's kept log lines: ``transport``, ``socket_fallback``."""
    text = "\n".join(line for lines in rank_lines for line in lines)
    line = transport_from_nccl_log(text, expect_ib)
    if line is None:
        subsys = environ.get("NCCL_DEBUG_SUBSYS")
        hint = f" (NCCL_DEBUG_SUBSYS={subsys} may leave out INIT)" if subsys else ""
        return {"transport": f"nccl: its log names no transport{hint}", "socket_fallback": False,
                "nccl_log": False}
    return {"transport": f"nccl: {line}", "socket_fallback": parse_nccl_log(text, expect_ib).socket_fallback,
            "nccl_log": True}


def gloo_transport(environ: Mapping[str, str] = os.environ) -> dict[str, Any]:
    """The report for a gloo group: TCP, on which interface, and plainly no NCCL log to judge."""
    ifname = environ.get("GLOO_SOCKET_IFNAME")
    where = (f"interface {ifname} (GLOO_SOCKET_IFNAME)" if ifname
             else "the interface of each host's name (gloo's default)")
    return {"transport": f"gloo over TCP on {where}; no NCCL log (NCCL did not run on CPU), so there is no "
                         "InfiniBand or socket fall-back to report",
            "socket_fallback": False, "nccl_log": False}
