"""Counting the metadata operations (opens, stats, renames, ...) that running processes make on a folder, with
strace: what a shared file system's metadata server pays for, whatever the process writes into files it holds.

:func:`trace_folder_ops` attaches ``strace -f`` to running processes (every thread, and the children they start
while traced) for some seconds and counts the calls that take a file name (strace's ``%file`` class: open and
openat, the stat family with newfstatat and statx, access, rename, unlink, mkdir, readlink, link, ...) whose
path lies under a folder, less one subfolder (checkpoints: saves are events, not a rate). Reads and writes on
files already open are not counted: they cost the data servers, not the metadata server. A stat of an open file
by its descriptor alone (``fstat``, ``newfstatat(fd, "", AT_EMPTY_PATH)``) is left out for the same reason.

Not a test file: tests/rank/runtime/test_run_folder_ops.py uses it, and a person can too::

    .venv/bin/python -m tests.strace_ops RUN_DIR SECONDS PID [PID ...]
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["FolderOps", "StraceUnavailableError", "ensure_strace", "trace_folder_ops"]

# strace's class of the calls that take a file name: every metadata operation, on any architecture's names.
TRACE = "%file"
# `[pid 12] openat(AT_FDCWD</cwd>, "path", ...` (or without the pid prefix): the call and its arguments.
_CALL = re.compile(r"^(?:\[pid\s+(?P<pid>\d+)\]\s+|(?P<bare>\d+)\s+)?(?P<name>[a-z_0-9]+)\((?P<args>.*)$")
_STRING = re.compile(r'"((?:[^"\\]|\\.)*)"')
_TWO_NAMES = ("rename", "link", "symlink")  # the name a call makes is the second
_AT_CWD = re.compile(r"AT_FDCWD<(?P<path>[^>]*)>")
_FD = re.compile(r"^(?:AT_FDCWD|-?\d+)<(?P<path>[^>]*)>")
DETACH_S = 15.0  # strace detaches in milliseconds; on a loaded machine, seconds


class StraceUnavailableError(RuntimeError):
    """strace is missing and cannot be installed here, or it may not attach (no ptrace): the reason why."""


@dataclass
class FolderOps:
    """What one trace counted: the calls on the folder by name and by path (relative to the folder)."""

    folder: Path
    seconds: float
    processes: int
    by_syscall: Counter[str] = field(default_factory=Counter)
    by_path: Counter[str] = field(default_factory=Counter)
    by_call: Counter[tuple[str, str]] = field(default_factory=Counter)  # (syscall, path)

    @property
    def total(self) -> int:
        return sum(self.by_syscall.values())

    def per_process_second(self, processes: int | None = None) -> float:
        return self.total / max(processes or self.processes, 1) / max(self.seconds, 1e-9)

    def without(self, patterns: tuple[str, ...]) -> FolderOps:
        """These counts less the paths that match any of ``patterns`` (``fnmatch``, relative to the folder)."""
        from fnmatch import fnmatch

        kept = FolderOps(self.folder, self.seconds, self.processes)
        for (name, path), count in self.by_call.items():
            if not any(fnmatch(path, pattern) for pattern in patterns):
                kept.by_syscall[name] += count
                kept.by_path[path] += count
                kept.by_call[name, path] += count
        return kept

    def describe(self, top: int = 20) -> str:
        """Each path hit, most first, with its calls: what a failing test says."""
        lines = [f"{self.total} operations on {self.folder} in {self.seconds:.1f} s by {self.processes} "
                 f"processes ({self.per_process_second():.3f} per process per second)"]
        for path, count in self.by_path.most_common(top):
            calls = ", ".join(f"{name} {n}" for (name, hit), n in self.by_call.most_common() if hit == path)
            lines.append(f"  {count:6d}  {path}  ({calls})")
        return "\n".join(lines)


def ensure_strace() -> str:
    """The strace command; as root it is installed with apt-get when missing (as scripts/test.sh installs it).
    Raises :class:`StraceUnavailableError` with the reason otherwise."""
    found = shutil.which("strace")
    if found:
        return found
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        raise StraceUnavailableError("strace is not installed (apt-get install strace, as root)")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for command in (["apt-get", "install", "-y", "-qq", "strace"], ["apt-get", "update", "-qq"],
                    ["apt-get", "install", "-y", "-qq", "strace"]):
        subprocess.run(command, env=env, capture_output=True, check=False, timeout=600)
        if found := shutil.which("strace"):
            return found
    raise StraceUnavailableError("strace is not installed and apt-get install -y strace failed")


def trace_folder_ops(pids: list[int], folder: Path, seconds: float, exclude: tuple[str, ...] = ("checkpoints",),
                     detach_s: float = DETACH_S) -> FolderOps:
    """Attach strace to ``pids`` (every thread; children they start are followed) for ``seconds`` and count the
    calls on paths under ``folder`` but not under any of ``exclude`` (subfolders, relative to ``folder``); strace
    is killed if it has not detached ``detach_s`` after the window."""
    strace = ensure_strace()
    folder = Path(folder).resolve()
    cwds = {pid: _cwd(pid) for pid in pids}
    with tempfile.TemporaryDirectory(prefix="strace-ops-") as scratch:
        out = Path(scratch) / "trace"
        command = [strace, "-f", "-qq", "-y", "-s", "4096", "-e", f"trace={TRACE}", "-o", str(out)]
        for pid in pids:
            command += ["-p", str(pid)]
        tracer = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, start_new_session=True)
        started = time.monotonic()
        try:
            time.sleep(seconds)
        finally:
            elapsed = time.monotonic() - started  # the window: detaching is not part of it
            errors = _stop(tracer, detach_s)
        if "Operation not permitted" in errors or not out.exists():  # no ptrace here (a container without it)
            raise StraceUnavailableError(f"strace could not attach: {errors.strip()[:500]}")
        text = out.read_text(encoding="utf-8", errors="replace") if out.exists() else ""
    return count_ops(text, folder, elapsed, len(pids), cwds, exclude)


def _stop(tracer: subprocess.Popen[str], detach_s: float) -> str:
    """End the trace; strace's error output. SIGINT makes strace detach from every process and exit, but strace
    waits forever for a process caught in ``vfork`` (Python's ``subprocess`` start) whose child it holds stopped.
    Killed, strace lets the kernel detach both, and the processes run on; the trace file keeps what was written."""
    if tracer.poll() is None:
        tracer.send_signal(signal.SIGINT)
    try:
        return tracer.communicate(timeout=detach_s)[1]
    except subprocess.TimeoutExpired:
        tracer.kill()
        return tracer.communicate(timeout=60)[1]


def count_ops(text: str, folder: Path, seconds: float, processes: int, cwds: dict[int, str | None],
              exclude: tuple[str, ...] = ("checkpoints",)) -> FolderOps:
    """The calls of strace's output ``text`` on paths under ``folder``: relative names resolved against the
    call's directory descriptor (``-y`` prints its path) or else the process's working directory."""
    ops = FolderOps(folder, seconds, processes)
    cwds = dict(cwds)
    fallback = next((cwd for cwd in cwds.values() if cwd), None)
    for line in text.splitlines():
        match = _CALL.match(line)
        if match is None or "resumed>" in line:
            continue
        pid = int(match["pid"] or match["bare"] or 0)
        if seen := _AT_CWD.search(match["args"]):
            cwds[pid] = seen["path"]  # -y prints the working directory of each call relative to it
        if not cwds.get(pid):  # a thread or a child started while traced: its own, else the first process's
            cwds[pid] = _cwd(pid) or fallback
        path = _call_path(match["name"], match["args"], cwds[pid])
        if path is None:
            continue
        try:
            relative = Path(path).relative_to(folder).as_posix()
        except ValueError:
            continue
        if any(relative == sub or relative.startswith(f"{sub}/") for sub in exclude):
            continue
        ops.by_syscall[match["name"]] += 1
        ops.by_path[relative] += 1
        ops.by_call[match["name"], relative] += 1
    return ops


def _call_path(syscall: str, args: str, cwd: str | None) -> str | None:
    """The file name of a call's arguments, absolute (a rename's or a link's new name: a temporary name is new
    each time); None for a call on a descriptor alone."""
    strings = list(_STRING.finditer(args))
    if not strings:
        return None
    string = strings[-1] if syscall.startswith(_TWO_NAMES) else strings[0]
    name = string.group(1).encode("latin-1", "backslashreplace").decode("unicode_escape", "replace")
    if name == "":
        return None  # fstatat(fd, "", AT_EMPTY_PATH): a stat of an open file, not a lookup
    if name.startswith("/"):
        return os.path.normpath(name)
    before = args[: string.start()].rstrip(", ").rsplit(", ", 1)[-1]
    directory = _FD.match(before) if before else None
    base = directory["path"] if directory else cwd  # openat(dirfd</dir>, "name") or open("name")
    return os.path.normpath(os.path.join(base, name)) if base else None


def _cwd(pid: int) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/cwd")
    except OSError:
        return None


def descendants(pids: list[int]) -> list[int]:
    """``pids`` and every live process below them (a rank's data loader workers, its compile workers)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        children.setdefault(int(fields[1]), []).append(int(entry.name))
    found, todo = [], list(pids)
    while todo:
        pid = todo.pop()
        if pid not in found:
            found.append(pid)
            todo.extend(children.get(pid, []))
    return found


if __name__ == "__main__":
    if len(sys.argv) < 4:
        sys.exit(__doc__)
    traced = [int(pid) for pid in sys.argv[3:]]
    print(trace_folder_ops(descendants(traced), Path(sys.argv[1]), float(sys.argv[2])).describe(top=50))
