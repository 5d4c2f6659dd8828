"""How run-folder files are written and read: atomically, privately, and without failing on a torn file.

Ranks rewrite files that login-node commands read at any moment, and a run folder holds code that ranks
execute, so every writer goes through :func:`atomic_write` and every folder is checked by
:func:`refuse_shared_writable`.
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import re
import secrets
import stat
import sys
import threading
from collections.abc import Iterator
from functools import lru_cache
from pathlib import Path
from typing import Any, BinaryIO

from hpc_train.common.terminal import plain
from hpc_train.errors import ConfigError
from hpc_train.run.paths import CHECKPOINTS_DIR, FLIGHT_RECORDER_DIR, HEARTBEAT_DIR, LOGS_DIR, SUBMITIT_DIR, WANDB_DIR

__all__ = [
    "MAX_LINE",
    "MAX_RECORD_FILE",
    "MAX_TIME",
    "atomic_write",
    "finite",
    "folder_names",
    "held_folders",
    "open_folder",
    "open_record",
    "open_run_path",
    "parse_json",
    "read_json_object",
    "read_record_text",
    "record_lines",
    "refuse_link",
    "refuse_shared_writable",
    "run_file_stat",
    "small_int",
    "time_value",
    "warn_bad_record",
    "write_all",
]


def write_all(descriptor: int, data: bytes | memoryview) -> None:
    """Write all of ``data``: one ``write()`` where the system takes it whole (an ``O_APPEND`` record stays in
    one piece), then what is left after a short write (a full disk, a signal)."""
    written = os.write(descriptor, data)
    while written < len(data):
        written += os.write(descriptor, data[written:])


def atomic_write(path: Path, data: str | bytes, mode: int = 0o600) -> None:
    """Write ``data`` (text as UTF-8) to a new temporary name of its own, fsync, rename over ``path`` and fsync the
    folder: never a half file. The temporary name is random and created exclusively, never through a link, so
    neither a planted file nor a stale one of another node's same pid is written through."""
    tmp = path.with_name(f".{path.name}.tmp-{secrets.token_hex(8)}")
    descriptor = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | _CLOEXEC, mode)
    try:
        try:
            write_all(descriptor, data.encode("utf-8") if isinstance(data, str) else data)
            os.fchmod(descriptor, mode)  # whatever the umask took away
            os.fsync(descriptor)
        finally:
            os.close(descriptor)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    folder = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(folder)
    finally:
        os.close(folder)


# No record file of a run folder is legitimately larger; a bigger one is read only this far.
MAX_RECORD_FILE = 16 << 20
MAX_LINE = 1 << 20  # a longer line of a .jsonl record file is skipped (and said), the lines after it are read
MAX_TIME = 1e11  # seconds since the epoch (the year 5138): a later "time" is damage, and time.localtime fails on it
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_FILE_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | _CLOEXEC
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | _CLOEXEC
# The run folder's own subfolders (hpc_train.run.paths): a path whose parents carry these names is opened from the
# run folder down, one component at a time with O_NOFOLLOW, so that no link below the run folder is ever followed.
_SUBFOLDERS = frozenset({LOGS_DIR, CHECKPOINTS_DIR, HEARTBEAT_DIR, SUBMITIT_DIR, WANDB_DIR,
                         os.path.basename(FLIGHT_RECORDER_DIR)})


def _below(path: str) -> tuple[str, tuple[str, ...], str]:
    """(the folder above the run folder's own subfolders, those subfolders top down, the last name) of ``path``."""
    head, slash, name = path.rpartition("/")  # os.path.split, less its cost per file (32,768 files a command)
    return (*_split_folder(head if head or not slash else "/"), name)


@lru_cache(maxsize=256)
def _split_folder(folder: str) -> tuple[str, tuple[str, ...]]:
    """:func:`_below` of a folder, worked out once per folder: a login command reads 32,768 files of one ``logs/``
    at 16,384 ranks, and splitting each path anew was a third of its time."""
    head, parts = folder, []
    while head and (os.path.basename(head) in _SUBFOLDERS or _is_step_folder(head)):
        head, part = os.path.split(head)
        parts.append(part)
    return head, tuple(parts[::-1])


_STEP_FOLDER = re.compile(r"(step-|\.tmp-step-|\.trash-step-)[0-9]{8,}(-[0-9]+)?")


def _is_step_folder(path: str) -> bool:
    """A checkpoint folder of ``checkpoints/`` (``step-00000100``, ``.tmp-step-00000200-PID``), read from the run
    folder down like the rest. By its name only: any child of a folder called ``checkpoints`` would take a run
    root of that name that is a link (``~/checkpoints -> /scratch/u``) for part of the run folder, and refuse
    every file below it."""
    return _STEP_FOLDER.fullmatch(os.path.basename(path)) is not None and \
        os.path.basename(os.path.dirname(path)) == CHECKPOINTS_DIR


def open_run_path(path: str | Path, flags: int = _FILE_FLAGS, mode: int = 0o600) -> int:
    """A descriptor of ``path`` in a run folder, opened with ``flags`` (O_NOFOLLOW among them) through a descriptor
    of each of the run folder's subfolders on the way (``logs/``, ``checkpoints/``, ``logs/nccl-trace/``...), each
    opened O_NOFOLLOW too: a link anywhere below the run folder is never followed (OSError, ELOOP or ENOTDIR). One
    open per subfolder more than a plain open; none inside :func:`held_folders`, which opens each folder once."""
    top, parts, name = _below(os.fspath(path))
    if not parts:
        return os.open(path, flags, mode)
    held: dict[tuple[str, tuple[str, ...]], int] | None = getattr(_held, "folders", None)
    if held is not None:
        folder = held.get((top, parts))
        if folder is None:
            folder = held[(top, parts)] = _open_subfolders(top, parts)
        return os.open(name, flags, mode, dir_fd=folder)
    folder = _open_subfolders(top, parts)
    try:
        return os.open(name, flags, mode, dir_fd=folder)
    finally:
        os.close(folder)


def _open_subfolders(top: str, parts: tuple[str, ...]) -> int:
    """A descriptor of ``top/parts...``, each of ``parts`` opened O_NOFOLLOW relative to the one before."""
    folder = os.open(os.path.join(top, parts[0]), _DIR_FLAGS)
    try:
        for part in parts[1:]:
            inner = os.open(part, _DIR_FLAGS, dir_fd=folder)
            os.close(folder)
            folder = inner
    except BaseException:
        os.close(folder)
        raise
    return folder


_held = threading.local()


@contextlib.contextmanager
def held_folders() -> Iterator[None]:
    """Inside it (on this thread), each subfolder a file is read from is opened once and held until the end: a
    reader of 32,768 files of one ``logs/`` (16,384 ranks) opens ``logs/`` once instead of for every file. The
    files read are those of the folder as it was when first opened, as with one listing."""
    if getattr(_held, "folders", None) is not None:
        yield
        return
    _held.folders = {}
    try:
        yield
    finally:
        folders, _held.folders = _held.folders, None
        for descriptor in folders.values():
            os.close(descriptor)


def open_folder(path: str | Path) -> int:
    """A descriptor of a folder of a run folder (``logs/``), never through a link (:func:`open_run_path`): list it
    with ``os.scandir(fd)`` and open its files with ``dir_fd``."""
    return open_run_path(path, _DIR_FLAGS)


def folder_names(path: str | Path) -> list[str]:
    """The names in a folder of a run folder (``logs/``, ``submitit/``), never listed through a link; [] when it is
    missing, a link or not a folder."""
    try:
        descriptor = open_folder(path)
    except OSError:
        return []
    try:
        return os.listdir(descriptor)
    finally:
        os.close(descriptor)


def refuse_link(run_dir: Path, what: str = "RUN_DIR") -> None:
    """ConfigError (exit 2) when a run folder given to a login-node command is a symbolic link: its files would be
    another place's."""
    if os.path.islink(run_dir):
        raise ConfigError(what, f"{run_dir} is a symbolic link; hpc_train never reads a run folder through one",
                          "give the run folder itself (its real path), not a link to it")


def run_file_stat(path: str | Path) -> os.stat_result | None:
    """The ``fstat`` of a regular file of a run folder (:func:`open_run_path`), or None (missing, a link, a FIFO)."""
    try:
        descriptor = open_run_path(path)
    except OSError:
        return None
    try:
        info = os.fstat(descriptor)
    finally:
        os.close(descriptor)
    return info if stat.S_ISREG(info.st_mode) else None


def open_record(path: str | Path) -> BinaryIO:
    """A run-folder file opened for reading without following a link at any depth below the run folder
    (:func:`open_run_path`) or blocking: OSError when it or a subfolder on its way is a link, or it is a FIFO, a
    device or a folder (someone planted it; a reader would hang on it or read elsewhere)."""
    descriptor = open_run_path(path)
    if not stat.S_ISREG(os.fstat(descriptor).st_mode):
        os.close(descriptor)
        raise OSError(errno.EINVAL, f"not a regular file: {path}")
    return open(descriptor, "rb")


def read_record_text(path: str | Path) -> str:
    """The text of a run-folder record file (:func:`open_record`), at most :data:`MAX_RECORD_FILE` bytes,
    undecodable bytes replaced; "" when it is missing or not a regular file."""
    try:
        with open_record(path) as handle:
            return handle.read(MAX_RECORD_FILE).decode("utf-8", errors="replace")
    except OSError:
        return ""


def record_lines(path: str | Path, max_line: int = MAX_LINE, max_bytes: int = 1 << 30,
                 warn: bool = True) -> Iterator[tuple[int, str]]:
    """``(number, line)`` of each line of a ``.jsonl`` record file (:func:`open_record`), read in chunks: a line
    longer than ``max_line`` is skipped (with ``warn``, a warning names the file and line) and the lines after it
    are still read (a 30 MB line once hid every record after it). At most ``max_bytes`` are read, and that is said."""
    try:
        handle = open_record(path)
    except OSError:
        return
    say = (lambda line, problem: warn_bad_record(Path(path), line, problem)) if warn else (lambda *_: None)
    with handle:
        number, pending, skipping, total = 1, b"", False, 0
        while chunk := handle.read(1 << 20):
            total += len(chunk)
            *lines, rest = (pending + chunk).split(b"\n")
            for line in lines:
                if skipping:  # the end of a line said to be too long already
                    skipping = False
                elif len(line) > max_line:
                    say(number, f"is longer than {max_line >> 10} KiB")
                else:
                    yield number, line.decode("utf-8", errors="replace")
                number += 1
            if skipping or len(rest) > max_line:  # never kept whole: the rest of this line is dropped as it comes
                if not skipping:
                    say(number, f"is longer than {max_line >> 10} KiB")
                rest, skipping = b"", True
            pending = rest
            if total >= max_bytes:
                say(None, f"is over {max_bytes >> 20} MiB: what follows is not read")
                return
        if pending and not skipping:
            yield number, pending.decode("utf-8", errors="replace")


_INT_DIGITS = 19  # |value| < 2**63 has at most 19 digits


def _json_int(text: str) -> int:
    value = int(text) if len(text.lstrip("-")) <= _INT_DIGITS else 1 << 64
    if not -(1 << 63) <= value < 1 << 63:
        raise ValueError(f"holds the integer {text[:20]}... beyond 64 bits")
    return value


def _json_float(text: str) -> float | None:
    value = float(text)
    return value if math.isfinite(value) else None


def _no_constant(_: str) -> None:
    return None


# One decoder for every read (json.loads with hooks builds one a call: 16,384 of them at 16,384 ranks).
_DECODER = json.JSONDecoder(parse_int=_json_int, parse_float=_json_float, parse_constant=_no_constant)


def parse_json(text: str) -> Any:
    """JSON from a run-folder file, as its readers can use it: NaN, Infinity and a float beyond the float's range
    (``1e400``) become None (a diverged loss is a fact, not damage), an integer beyond 64 bits is damage
    (ValueError), and so is nesting too deep for the parser (RecursionError as ValueError). No reader meets a
    number that ``float()``, ``time.localtime`` or strict JSON output cannot take."""
    try:
        return _DECODER.decode(text)
    except RecursionError:
        raise ValueError("is nested too deep") from None


def finite(value: Any, low: float = -math.inf, high: float = math.inf) -> float | None:
    """``value`` as a float when it is a number (not a bool) within [low, high] and finite, else None: every number
    a reader takes from a run folder goes through here, so none overflows a float or a C long."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    if isinstance(value, int) and not -(1 << 63) <= value < 1 << 63:
        return None
    number = float(value)
    return number if math.isfinite(number) and low <= number <= high else None


def time_value(value: Any) -> float | None:
    """A time stamp from a run folder (seconds since the epoch), or None when it is not one a clock can show."""
    return finite(value, 0.0, MAX_TIME)


def small_int(text: str, digits: int = 9) -> int | None:
    """ASCII digits of a rank, task or step in a log line as an int, or None when there are more than ``digits``
    (a 5,000-digit rank is damage: ``int()`` refuses it, and a range over it never ends)."""
    return int(text) if 0 < len(text) <= digits and text.isascii() and text.isdigit() else None


def warn_bad_record(path: Path, line: int | None, problem: str) -> None:
    """One warning on stderr naming the file (and line) of a record that is skipped: a hand-edited or torn file
    is reported, never a crash. Control characters are shown escaped, never sent to the terminal."""
    where = f"{path}:{line}" if line else str(path)
    print(plain(f"warning: {where}: {problem}; skipped")[:500], file=sys.stderr)


def read_json_object(path: Path) -> dict[str, Any]:
    """A JSON object from the run folder, or {} when it is missing, torn or not an object: readers on the login
    node show what is there and never fail on a file a rank is rewriting."""
    try:
        data = parse_json(read_record_text(path))
    except ValueError:
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
