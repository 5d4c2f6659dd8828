"""A rank that ended on a signal without a traceback: which signal, and whether it was killed or crashed.

Why its own class: a ``kill -9`` from a node health agent or an administrator says nothing about the program, a
segfault in an extension says something about the program's native code, and an out-of-memory kill (found before
this, from Slurm and the cgroup) needs a change. ``unknown`` named none of these.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from hpc_train.failures.evidence import RankReport
from hpc_train.run.files import small_int
from hpc_train.run.loglines import parse_host_oom
from hpc_train.run.peer_errors import lost_its_peer

__all__ = ["SIGNAL_NAMES", "SignalDeath", "oom_peaks", "signal_class", "signal_death", "srun_signal"]

SIGNAL_NAMES = {1: "SIGHUP", 2: "SIGINT", 4: "SIGILL", 6: "SIGABRT", 7: "SIGBUS", 8: "SIGFPE", 9: "SIGKILL",
                11: "SIGSEGV", 15: "SIGTERM"}
_OOM_WORDS = "out of memory: rank "  # how the agent's line begins (run.loglines.HOST_OOM): most lines skip the pattern
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
            return small_int(m[1], 3) if number == 0 else number  # "signal 999...9" (5,000 digits) is no signal
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
            if _OOM_WORDS in line and (found := parse_host_oom(line)) is not None:
                rank, process, cgroup, limit = found
                said.append(f"rank {rank} peaked at {process:.2f} GiB"
                            + (f", its cgroup at {cgroup:.2f}" + (f" of {limit:.2f}" if limit else "") + " GiB"
                               if cgroup is not None else ""))
    return "; ".join(dict.fromkeys(said))


@dataclass(frozen=True)
class SignalDeath:
    """The rank that died on a signal: its task, node ("" when unknown) and srun's words for it, and the signal
    (None: unknown)."""

    task: int
    node: str
    words: str
    signal: int | None

    @property
    def where(self) -> str:
        return self.node or "an unknown node"

    def line(self) -> str:
        """srun's line for the death; where srun wrote none, what showed it instead (not dressed as srun's)."""
        head = f"srun: {self.where}: task {self.task}: " if self.signal else f"rank {self.task} on {self.where}: "
        return head + self.words


def signal_death(srun: Mapping[int, tuple[str, str, str]], reports: Iterable[RankReport],
                 node_of: Callable[[RankReport], str]) -> SignalDeath | None:
    """Which task died on a signal, from srun's lines (task: (node, tasks, words)) and the ranks' reports;
    ``node_of`` names a rank's node where srun did not (a rank that left no error record has no host of its own).

    Once a task dies, srun terminates the others (``--kill-on-bad-exit``): their SIGTERM is a consequence, so any
    other signal names the task first. Under load srun can be force-terminated before it writes the dead task's
    line. Then its only line is a SIGTERM for a rank that merely lost its peer, and the rank that left no error at
    all is the one that died, of a signal srun did not say."""
    deaths = sorted((signal == 15, task, node, words) for task, (node, _tasks, words) in srun.items()
                    if (signal := srun_signal(words)) is not None)
    if not deaths:
        return None
    terminated, task, node, words = deaths[0]
    if not terminated:
        return SignalDeath(task, node, words, srun_signal(words))
    by_rank = {report.rank: report for report in reports}
    victim = by_rank.get(task)
    silent = [r for r in by_rank.values() if r.rank != task and not r.error and not r.traceback]
    if victim is not None and lost_its_peer(f"{victim.error}\n{victim.traceback}") and len(silent) == 1:
        dead = silent[0]
        return SignalDeath(dead.rank, node_of(dead), f"no srun line for it; rank {task} on "
                           f"{node} only lost its peer and was terminated after it", None)
    return SignalDeath(task, node, words, 15)
