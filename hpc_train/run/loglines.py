"""The log lines the login side parses, each defined once: the writer's formatter beside the reader's pattern.

Ranks write these lines into their node's ``logs/ranks-FIRST-LAST.log``; ``hpc_train.login.ops`` finds an attempt's
part of a rank's lines, the step a signal saved and the ranks a hang names by reading them back. A formatter and
its parser live side by side here (and a test formats and parses each), so that rewording a line cannot silently
blind the reader.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import datetime

__all__ = [
    "BATCH_START", "HOST_OOM", "LAUNCH_ERROR_PREFIX", "NOT_IN_COLLECTIVE", "RANK_LINE", "RANK_RECORD", "START",
    "STOPPED", "StartLine", "format_host_oom", "format_launch_error", "format_not_in_collective",
    "format_saved_after_signal", "format_start", "format_stopped", "parse_host_oom", "parse_start", "parse_stop",
    "rank_line_time",
    "rank_log_format",
]

# -- the record prefix: logging's "%(asctime)s rankN LEVEL message" ----------------------------------------

_STAMP = r"[0-9]{4}-[0-9][0-9]-[0-9][0-9] [0-9][0-9]:[0-9][0-9]:[0-9][0-9],[0-9]{3}"
RANK_LINE = re.compile(rf"^({_STAMP}) rank[0-9]+ ([A-Z]+) ")  # groups: time stamp, level
RANK_RECORD = re.compile(rf"^({_STAMP}) rank([0-9]+) ([A-Z]+) ?(.*)$")  # groups: time stamp, rank, level, message


def rank_log_format(rank: int) -> str:
    """The :class:`logging.Formatter` format of rank ``rank``'s log (time stamps as logging writes them)."""
    return f"%(asctime)s rank{rank} %(levelname)s %(message)s"


# -- an attempt's first line ---------------------------------------------------------------------------------

START = re.compile(r"start: (\S+) rank ([0-9]+)/([0-9]+) \(local [0-9]+/[0-9]+, node ([0-9]+)/([0-9]+)\) job (\S+) "
                   r"restart ([0-9]+)")


@dataclass(frozen=True)
class StartLine:
    """What an attempt's start line says: the launcher, where the rank sits, and which job and restart."""

    launcher: str
    rank: int
    world_size: int
    node_rank: int
    num_nodes: int
    job_id: str
    restart: int


def format_start(launcher: str, rank: int, world_size: int, local_rank: int, local_world_size: int,
                 node_rank: int, num_nodes: int, job_id: str, restart: int, host: str) -> str:
    """The line each rank logs first in every attempt: the reader splits a rank log into attempts at it."""
    return (f"start: {launcher} rank {rank}/{world_size} (local {local_rank}/{local_world_size}, node "
            f"{node_rank}/{num_nodes}) job {job_id} restart {restart} on {host}")


def parse_start(line: str) -> StartLine | None:
    """What a start line says, or None (no start line, or a number of more than 9 digits: damage, which ``int()``
    refuses past 4,300 digits and no rank or node reaches)."""
    m = START.search(line)
    if m is None or any(len(m[group]) > 9 for group in (2, 3, 4, 5, 7)):
        return None
    return StartLine(m[1], int(m[2]), int(m[3]), int(m[4]), int(m[5]), m[6], int(m[7]))


# -- a stop after a signal -----------------------------------------------------------------------------------

STOPPED = re.compile(r"saved step ([0-9]+) [0-9.]+ s after (SIG\w+)|"
                     r"stopped (?:after step ([0-9]+)|at an unknown step) on (SIG\w+)")


def format_saved_after_signal(step: int, seconds: float, signal_name: str, requeued: bool, reason: str) -> str:
    """Rank 0's line once the save after a preemption signal is durable (trainer)."""
    return f"saved step {step} {seconds:.1f} s after {signal_name}; " + \
        ("requeued: " if requeued else "not requeued: ") + reason


def format_stopped(step: int | None, signal_name: str, action: str, reason: str, exit_code: int) -> str:
    """Every rank's last line after it stopped on a signal (launch); ``step`` None: a script that never said
    its step (no ``ctx.log``, no integration)."""
    where = f"after step {step}" if step is not None else "at an unknown step"
    return f"stopped {where} on {signal_name} ({action}: {reason}); exit status {exit_code}"


def parse_stop(line: str) -> tuple[int | None, str] | None:
    """``(step, signal)`` of either stop line (step None where it was unknown), or None."""
    m = STOPPED.search(line)
    if not m or len(m[1] or m[3] or "") > 18:  # a step of more digits is damage (int() refuses 4,300)
        return None
    step = m[1] or m[3]
    return (int(step) if step else None, m[2] or m[4])


# -- the watchdog's suspects -----------------------------------------------------------------------------------

NOT_IN_COLLECTIVE = re.compile(r"hang: rank ([0-9]+) is not in a collective")  # the watchdog on rank 0


def format_not_in_collective(rank: int, frame: str) -> str:
    return f"hang: rank {rank} is not in a collective: {frame}"


# -- the agent on an out-of-memory kill --------------------------------------------------------------------------

HOST_OOM = re.compile(r"out of memory: rank ([0-9]+) was killed by the memory limit of its cgroup; its largest "
                      r"process peaked at ([0-9.]+) GiB(?:, the cgroup at ([0-9.]+) GiB(?: of its ([0-9.]+) GiB "
                      r"limit)?)?")


def format_host_oom(rank: int, process_bytes: int, cgroup_bytes: int | None, limit_bytes: int | None) -> str:
    """The agent's line when its rank's cgroup killed it: the peaks that say how far over it went."""
    line = (f"out of memory: rank {rank} was killed by the memory limit of its cgroup; its largest process peaked "
            f"at {process_bytes / 2**30:.2f} GiB")
    if cgroup_bytes is not None:
        line += f", the cgroup at {cgroup_bytes / 2**30:.2f} GiB"
        if limit_bytes is not None:
            line += f" of its {limit_bytes / 2**30:.2f} GiB limit"
    return line


def parse_host_oom(line: str) -> tuple[int, float, float | None, float | None] | None:
    """(rank, the process's peak, the cgroup's peak, the limit) in GiB, or None."""
    m = HOST_OOM.search(line)
    if not m or len(m[1]) > 9:  # a rank of more digits is damage (int() refuses 4,300)
        return None
    try:
        return int(m[1]), float(m[2]), float(m[3]) if m[3] else None, float(m[4]) if m[4] else None
    except ValueError:  # "1.2.3" matches [0-9.]+
        return None


# -- the batch step's output ------------------------------------------------------------------------------------

LAUNCH_ERROR_PREFIX = "hpc_train.launch: "  # a wrong launch, said in one line on every rank's stderr
BATCH_START = re.compile(r"hpc_train: job \S+ restart [0-9]+")  # echoed by sbatch_templates/_preamble.j2


def format_launch_error(error: object) -> str:
    return f"{LAUNCH_ERROR_PREFIX}{error}"


def rank_line_time(line: str) -> float | None:
    """Seconds since the epoch of a rank log line's time stamp (local time, as logging wrote it)."""
    m = RANK_LINE.match(line)
    if not m:
        return None
    try:
        return datetime.strptime(m[1], "%Y-%m-%d %H:%M:%S,%f").timestamp()
    except ValueError:
        return None
