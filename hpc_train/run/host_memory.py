"""A rank's host memory as its node sees it: the memory cgroup it runs in (Slurm's job or step cgroup, cgroup
v2 or v1), how many processes that cgroup's out-of-memory killer has ended, how high its usage peaked against
its limit, and the peak resident set of the largest process this one has waited for. The agent uses it to tell
an out-of-memory kill from an outside kill, and to say how close to the limit its rank came."""

from __future__ import annotations

import resource
from dataclasses import dataclass
from pathlib import Path

__all__ = ["MemoryPeak", "available_memory", "memory_cgroup", "memory_peak", "oom_kills"]

_CGROUP_ROOT = Path("/sys/fs/cgroup")
_NO_LIMIT = 1 << 60  # cgroup v1 writes "no limit" as a page-rounded 2^63 - 1


def available_memory() -> int | None:
    """``MemAvailable`` in bytes (what the node can still give without swapping), or None where unknown."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def memory_cgroup(proc_cgroup: str | None = None) -> tuple[Path, int] | None:
    """(the folder, the cgroup version) of this process's memory cgroup, or None when there is none. cgroup v1
    names the memory controller on a line of its own; v2 has the one unified line ``0::/path``."""
    try:
        text = proc_cgroup if proc_cgroup is not None else Path("/proc/self/cgroup").read_text(encoding="utf-8")
    except OSError:
        return None
    unified = None
    for line in text.splitlines():
        number, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if "memory" in controllers.split(","):
            return _CGROUP_ROOT / "memory" / path.lstrip("/"), 1
        if number == "0" and not controllers:
            unified = _CGROUP_ROOT / path.lstrip("/")
    if unified is not None and (unified / "memory.events").exists():
        return unified, 2
    return None


def _read(folder: Path, name: str) -> str | None:
    try:
        return (folder / name).read_text(encoding="utf-8")
    except OSError:
        return None


def oom_kills(cgroup: tuple[Path, int] | None = None) -> int:
    """How many processes the memory cgroup's out-of-memory killer has ended so far; 0 when unknown."""
    cgroup = cgroup or memory_cgroup()
    if cgroup is None:
        return 0
    folder, version = cgroup
    for row in (_read(folder, "memory.events" if version == 2 else "memory.oom_control") or "").splitlines():
        name, _, count = row.partition(" ")
        if name == "oom_kill" and count.strip().isdigit():
            return int(count)
    return 0


@dataclass(frozen=True)
class MemoryPeak:
    """The peaks in bytes: the largest waited-for child process's resident set, and the cgroup's usage and
    limit (None where the node does not say)."""

    process_bytes: int
    cgroup_bytes: int | None
    limit_bytes: int | None


def _number(text: str | None) -> int | None:
    value = (text or "").strip()
    return int(value) if value.isdigit() and int(value) < _NO_LIMIT else None


def memory_peak(cgroup: tuple[Path, int] | None = None) -> MemoryPeak:
    """What this process's children and its memory cgroup peaked at, for an out-of-memory kill's message."""
    process = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024  # Linux counts KiB
    cgroup = cgroup or memory_cgroup()
    if cgroup is None:
        return MemoryPeak(process, None, None)
    folder, version = cgroup
    peak, limit = ("memory.peak", "memory.max") if version == 2 else ("memory.max_usage_in_bytes",
                                                                     "memory.limit_in_bytes")
    return MemoryPeak(process, _number(_read(folder, peak)), _number(_read(folder, limit)))
