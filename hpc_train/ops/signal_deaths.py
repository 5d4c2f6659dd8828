"""A rank that ended on a signal without a traceback: which signal, and whether it was killed or crashed.

Why its own class: a ``kill -9`` from a node health agent or an administrator says nothing about the program, a
segfault in an extension says something about the program's native code, and an out-of-memory kill (found before
this, from Slurm and the cgroup) needs a change. ``unknown`` named none of these.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from hpc_train.ops.evidence import RankReport
from hpc_train.run.loglines import parse_host_oom

__all__ = ["SIGNAL_NAMES", "oom_peaks", "signal_class", "srun_signal"]

SIGNAL_NAMES = {1: "SIGHUP", 2: "SIGINT", 4: "SIGILL", 6: "SIGABRT", 7: "SIGBUS", 8: "SIGFPE", 9: "SIGKILL",
                11: "SIGSEGV", 15: "SIGTERM"}
_CRASH_SIGNALS = frozenset({4, 6, 7, 8, 11})
# srun's words for a task that ended on a signal, and the signal each names
_SRUN_SIGNAL_WORDS = ((re.compile(r"Segmentation fault"), 11), (re.compile(r"Bus error"), 7),
                      (re.compile(r"Aborted"), 6), (re.compile(r"Illegal instruction"), 4),
                      (re.compile(r"Floating point exception"), 8), (re.compile(r"Killed"), 9),
                      (re.compile(r"Terminated"), 15), (re.compile(r"signal ([0-9]+)"), 0))


def srun_signal(message: str) -> int | None:
    """The signal srun's line for a task names ("Killed": 9, "Segmentation fault": 11, "signal 7"), or None."""
    for pattern, number in _SRUN_SIGNAL_WORDS:
        if m := pattern.search(message):
            return int(m[1]) if number == 0 else number
    return None


def signal_class(signal: int) -> tuple[str, str]:
    """(class, what it means) of a rank that ended on ``signal`` without a traceback."""
    name = SIGNAL_NAMES.get(signal, f"signal {signal}")
    if signal in _CRASH_SIGNALS:
        return "crashed", f"crashed: {name} in native code (an extension, a driver, a library)"
    return "killed", f"killed: {name} from outside the program (a node health agent, an administrator, the " \
                     "kernel's OOM killer outside the job's cgroup)"


def oom_peaks(reports: Iterable[RankReport]) -> str:
    """What the agents said of their ranks' out-of-memory kills, as the message's words ("rank 1 peaked at 3.20
    GiB, its cgroup at 3.98 of 4.00 GiB"), or "" when no agent saw one (:func:`hpc_train.run.loglines.
    format_host_oom`)."""
    said = []
    for report in reports:
        for line in report.log_tail:
            if (found := parse_host_oom(line)) is not None:
                rank, process, cgroup, limit = found
                said.append(f"rank {rank} peaked at {process:.2f} GiB"
                            + (f", its cgroup at {cgroup:.2f}" + (f" of {limit:.2f}" if limit else "") + " GiB"
                               if cgroup is not None else ""))
    return "; ".join(dict.fromkeys(said))
