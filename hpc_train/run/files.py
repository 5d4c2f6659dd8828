"""How run-folder files are written and read: atomically, privately, and without failing on a torn file.

Ranks rewrite files that login-node commands read at any moment, and a run folder holds code that ranks
execute, so every writer goes through :func:`atomic_write` and every folder is checked by
:func:`refuse_shared_writable`.
"""

from __future__ import annotations

import errno
import json
import os
import stat
import sys
from pathlib import Path
from typing import Any, BinaryIO

from hpc_train.errors import ConfigError
from hpc_train.terminal import plain

__all__ = ["MAX_RECORD_FILE", "atomic_write", "open_record", "read_json_object", "read_record_text",
           "refuse_shared_writable", "warn_bad_record"]


def atomic_write(path: Path, text: str, mode: int = 0o600) -> None:
    """Write to a temporary name, fsync, rename over ``path`` and fsync the folder: never a half file."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    descriptor = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, mode)
    with open(descriptor, "w", encoding="utf-8") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.chmod(tmp, mode)
    os.replace(tmp, path)
    folder = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(folder)
    finally:
        os.close(folder)


# No record file of a run folder is legitimately larger; a bigger one is read only this far.
MAX_RECORD_FILE = 16 << 20


def open_record(path: Path) -> BinaryIO:
    """A run-folder file opened for reading without following a link or blocking: OSError when it is a link, a
    FIFO, a device or a folder (someone planted it; a reader would hang on it or read elsewhere)."""
    descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
    if not stat.S_ISREG(os.fstat(descriptor).st_mode):
        os.close(descriptor)
        raise OSError(errno.EINVAL, f"not a regular file: {path}")
    return open(descriptor, "rb")


def read_record_text(path: Path) -> str:
    """The text of a run-folder record file (:func:`open_record`), at most :data:`MAX_RECORD_FILE` bytes,
    undecodable bytes replaced; "" when it is missing or not a regular file."""
    try:
        with open_record(path) as handle:
            return handle.read(MAX_RECORD_FILE).decode("utf-8", errors="replace")
    except OSError:
        return ""


def warn_bad_record(path: Path, line: int | None, problem: str) -> None:
    """One warning on stderr naming the file (and line) of a record that is skipped: a hand-edited or torn file
    is reported, never a crash. Control characters are shown escaped, never sent to the terminal."""
    where = f"{path}:{line}" if line else str(path)
    print(plain(f"warning: {where}: {problem}; skipped")[:500], file=sys.stderr)


def read_json_object(path: Path) -> dict[str, Any]:
    """A JSON object from the run folder, or {} when it is missing, torn or not an object: readers on the login
    node show what is there and never fail on a file a rank is rewriting."""
    try:
        data = json.loads(read_record_text(path))
    except (ValueError, RecursionError):
        return {}
    return data if isinstance(data, dict) else {}


def refuse_shared_writable(path: Path) -> None:
    """ConfigError unless ``path`` is ours and not writable by group or others: ranks execute what it holds."""
    mode = path.stat().st_mode
    if mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise ConfigError(str(path), f"is writable by others (mode {stat.filemode(mode)}); a run folder holds "
                          "code that ranks execute", f"chmod go-w {path}, or pick another job.run_root")
    if path.stat().st_uid != os.getuid():
        raise ConfigError(str(path), "belongs to another user", "pick another job.name or job.run_root")
