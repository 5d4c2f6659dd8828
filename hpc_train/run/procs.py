"""The processes of this machine, read from ``/proc``: one reader for every question the run asks of them (the
processes below an agent, a local rank's pid, a job's processes on a node).

Why here: each question needs the same parsing (the state, parent and start time after the command name in
``stat``, which may itself hold spaces and parentheses; the environment and command line as raw bytes), and a
process can end between two reads, so every read may find it gone. Linux only, like Slurm's nodes. And how a node
agent's CPUs are shared among the ranks it starts (:func:`cpu_shares`).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Process", "command_line", "cpu_shares", "descendants", "environment", "leave_like", "parent_death_signal",
           "processes", "tie_to_parent"]

_PROC = Path("/proc")


@dataclass(frozen=True)
class Process:
    """One process: its pid, its parent's, its state letter (Z: a zombie) and its start in clock ticks since boot."""

    pid: int
    parent: int
    state: str
    start: int

    @property
    def alive(self) -> bool:
        return self.state not in ("Z", "X")


def processes() -> Iterator[Process]:
    """Every process readable now; one that ends while it is read is left out."""
    for entry in _PROC.iterdir():
        if not (entry.name.isascii() and entry.name.isdigit()):
            continue
        try:
            fields = (entry / "stat").read_text(encoding="utf-8").rsplit(")", 1)[1].split()
            yield Process(int(entry.name), int(fields[1]), fields[0], int(fields[19]))
        except (OSError, IndexError, ValueError):
            continue


def environment(pid: int) -> dict[bytes, bytes] | None:
    """The environment ``pid`` started with, or None when it cannot be read (gone, or another user's)."""
    try:
        raw = (_PROC / str(pid) / "environ").read_bytes()
    except OSError:
        return None
    return dict(item.split(b"=", 1) for item in raw.split(b"\0") if b"=" in item)


def command_line(pid: int) -> bytes | None:
    """``pid``'s command line (NUL-separated), or None when it cannot be read."""
    try:
        return (_PROC / str(pid) / "cmdline").read_bytes()
    except OSError:
        return None


def descendants(pid: int, skip: Collection[int] = (), alive: bool = False) -> list[int]:
    """Every process below ``pid``, children first; zombies not yet reaped too (a kill of one is harmless), or
    with ``alive`` only the living. The subtrees of ``skip`` (and those pids) are left out."""
    children: dict[int, list[int]] = {}
    living: set[int] = set()
    for process in processes():
        children.setdefault(process.parent, []).append(process.pid)
        if process.alive:
            living.add(process.pid)
    found, todo = [], [pid]
    while todo:
        below = [child for child in children.get(todo.pop(), []) if child not in skip]
        found += below
        todo += below
    return [pid for pid in found if pid in living] if alive else found


def kill_tree(pid: int) -> None:
    """SIGKILL to ``pid`` and every process below it (one already gone is passed over)."""
    for each in [pid, *descendants(pid)]:
        try:
            os.kill(each, signal.SIGKILL)
        except ProcessLookupError:
            continue


def cpu_shares(ranks: int) -> list[set[int]]:
    """The node's CPUs this process may use, in ``ranks`` blocks of consecutive CPUs (a rank's share, as srun binds
    one task per rank, and near the GPU of its local rank on the usual layouts); empty when there are too few."""
    try:
        cpus = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return []
    if ranks < 2 or len(cpus) < ranks:
        return []
    size = len(cpus) // ranks
    return [set(cpus[index * size:(index + 1) * size]) for index in range(ranks)]


def parent_death_signal(signum: int = 9) -> Callable[[], None]:
    """A function that asks Linux to send the calling process ``signum`` (default SIGKILL) when the thread that
    started it ends (``prctl(PR_SET_PDEATHSIG)``): a local job's controller and ranks, in a session of their own,
    then never train on unfollowed after ``submit`` is killed. prctl is looked up here, in the parent, so that a
    forked child (``preexec_fn``) only calls it; a no-op where prctl is missing."""
    import ctypes

    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return lambda: None
    return lambda: prctl(1, signum, 0, 0, 0) and None  # 1: PR_SET_PDEATHSIG


def tie_to_parent(parent: int, signum: int = 9) -> bool:
    """Ask for ``signum`` when the parent ends (:func:`parent_death_signal`), then close the window before the
    request: False when ``parent`` had already ended (the caller was reparented, and no signal will ever come)."""
    parent_death_signal(signum)()
    if os.getppid() == parent:
        return True
    try:
        os.kill(parent, 0)  # a parent that is alive but not ours (a shell between) still ties through it
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def leave_like(code: int) -> int:
    """Leave as a child did (``code``: its status, negative for a signal): a child that died of a signal makes this
    process die of it (an agent, so that srun reports what its rank did); else ``code`` to exit with."""
    if code < 0:
        logging.shutdown()
        sys.stdout.flush()
        if -code not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
        time.sleep(1)  # a signal that does not end a process by default: leave with the shell's status for it
        return 128 - code
    return code
