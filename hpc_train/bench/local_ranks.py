"""Benchmarks whose ranks are copies of the script on this machine: a free port, and the ranks started and
waited for (``--port`` and ``--rank`` added to each copy's arguments)."""

from __future__ import annotations

import socket
import subprocess
import sys
from collections.abc import Sequence

__all__ = ["free_port", "run_ranks"]


def free_port() -> int:
    """A TCP port on the loopback that nothing listens on now (for a rendezvous started right after)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def run_ranks(script: str, args: Sequence[str], count: int = 2, timeout_s: float = 900) -> None:
    """``script`` run as ``count`` ranks with ``args``; SystemExit naming the exit statuses if any rank failed."""
    command = [sys.executable, script, *args, "--port", str(free_port())]
    ranks = [subprocess.Popen([*command, "--rank", str(rank)]) for rank in range(count)]
    codes = [rank.wait(timeout=timeout_s) for rank in ranks]
    if any(codes):
        raise SystemExit(f"a rank failed: exit statuses {codes}")
