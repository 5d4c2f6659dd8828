"""Reading the many small files of a large run folder: each one as :func:`hpc_train.run.files.open_record` reads
a record (never through a link, never a FIFO or a device, at most a bounded size), at the cost of a few system
calls rather than a buffered file object and a read of :data:`~hpc_train.run.files.MAX_RECORD_FILE` bytes.

Why: at 16,384 ranks every rank's error record and log is read by ``status``, ``logs``, the failure classes and the
follower; a buffered ``read(16 MiB)`` costs about 28 us a file, these reads about 7 us (issue 38). Also here: the
rank log's time stamp read once per second of the clock rather than by ``strptime`` per line.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Callable
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

from hpc_train.run.files import MAX_RECORD_FILE, open_run_path, parse_json
from hpc_train.run.loglines import RANK_LINE

__all__ = ["RankFiles", "line_time", "open_bytes", "read_bytes", "read_json", "read_tail", "read_text", "stamp_time"]

_SENTINEL = 987654321


def open_bytes(path: str | Path, limit: int = MAX_RECORD_FILE, tail: bool = False) -> tuple[bytes, int]:
    """(a regular file's first ``limit`` bytes, or with ``tail`` all from its last ``limit`` bytes' start to its
    end; its size when opened); OSError when it is missing, a link (or below one: ``logs/`` a link), a FIFO, a
    device or a folder (as :func:`~hpc_train.run.files.open_record`)."""
    descriptor = open_run_path(path)
    try:
        info = os.fstat(descriptor)
        if not stat.S_ISREG(info.st_mode):
            raise OSError(errno.EINVAL, f"not a regular file: {path}")
        start = max(0, info.st_size - limit) if tail else 0
        if start:
            os.lseek(descriptor, start, os.SEEK_SET)
        chunks, total = [], 0
        while True:  # a short read is the end (a regular file); one that grew meanwhile is read on to its end
            ask = max(info.st_size - start - total, 0) + (1 << 16)
            ask = ask if tail else min(ask, limit - total)
            chunk = os.read(descriptor, ask) if ask > 0 else b""
            chunks.append(chunk)
            total += len(chunk)
            if len(chunk) < ask or ask <= 0:
                return b"".join(chunks), info.st_size
    finally:
        os.close(descriptor)


def read_bytes(path: str | Path, limit: int = MAX_RECORD_FILE, tail: bool = False) -> bytes | None:
    """:func:`open_bytes`, or None where it raises."""
    try:
        return open_bytes(path, limit, tail)[0]
    except OSError:
        return None


def read_text(path: str | Path) -> str:
    """As :func:`hpc_train.run.files.read_record_text`: at most MAX_RECORD_FILE bytes, "" when unreadable."""
    data = read_bytes(path)
    return data.decode("utf-8", errors="replace") if data else ""


def read_json(path: str | Path) -> dict[str, Any]:
    """As :func:`hpc_train.run.files.read_json_object`: a JSON object, or {} (missing, torn, not an object, a
    number out of range: :func:`~hpc_train.run.files.parse_json`)."""
    try:
        data = parse_json(read_text(path))
    except ValueError:
        return {}
    return data if isinstance(data, dict) else {}


def read_tail(path: str | Path, limit: int) -> str:
    """A log's last ``limit`` bytes from the first whole line; "" when unreadable."""
    data = read_bytes(path, limit, tail=True)
    if data is None:
        return ""
    text = data.decode("utf-8", errors="replace")
    return text if len(data) < limit else text.partition("\n")[2]


@lru_cache(maxsize=4096)
def _second(clock: str) -> float | None:
    try:
        return datetime.strptime(clock, "%Y-%m-%d %H:%M:%S").timestamp()
    except ValueError:
        return None


def stamp_time(stamp: str) -> float | None:
    """``2026-11-30 03:15:30,123`` (logging's asctime) as seconds since the epoch, local time: the same float
    as ``datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").timestamp()``, parsed once per second of the clock."""
    clock, comma, fraction = stamp.partition(",")
    if not (comma and fraction.isascii() and fraction.isdigit() and len(fraction) <= 6):
        return None
    whole = _second(clock)
    return None if whole is None else whole + int(fraction.ljust(6, "0")) / 1e6


def line_time(line: str) -> float | None:
    """As :func:`hpc_train.run.loglines.rank_line_time`: the time stamp of a rank log line, or None."""
    m = RANK_LINE.match(line)
    return stamp_time(m[1]) if m else None


class RankFiles:
    """The per-rank file names of one run folder as plain strings, from :mod:`hpc_train.run.paths`' own functions
    (a ``Path`` per file costs more than reading the file)."""

    def __init__(self, run_dir: Path, name: Callable[[Path, int], Path]) -> None:
        self.head, _, self.tail = str(name(Path(run_dir), _SENTINEL)).rpartition(str(_SENTINEL))
        self.base = os.path.basename(self.head)

    def __call__(self, rank: int) -> str:
        return f"{self.head}{rank}{self.tail}"

    def name(self, rank: int) -> str:
        """The file's name without its folder."""
        return f"{self.base}{rank}{self.tail}"
