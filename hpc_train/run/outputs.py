"""The one writer of what a command is asked to write: ``--out`` of ``plot``, ``render``, ``ckpt export`` and
``bench``.

Why one: an output path is the user's to name, and it can name anything. Each command had its own checks, and each
missed another case: ``plot --out`` naming a FIFO hung (opening a FIFO for writing waits for a reader for ever),
a device got the bytes of a picture, ``render --out`` into a folder it could not write made the run folder first
and failed after. Here every output is checked by :func:`check_output` before anything at all is written, with one
message naming the path and the fix (exit 2), and written by :func:`write_output` / :func:`open_output`: a
temporary file beside it (``O_CREAT | O_EXCL | O_NOFOLLOW``, 0600 while it is written), fsync, rename over the
path, fsync of the folder. A reader never sees half a file, and a link planted between the check and the rename
is replaced, never followed.

What is accepted: a regular file (replaced, when the command allows it), or a new name in an existing folder that
you can write. What is refused: a symbolic link (to where, and whose?), a folder, a FIFO, a socket, a device, a
missing folder, a folder you cannot write.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

from hpc_train.errors import ConfigError

__all__ = ["check_output", "open_output", "write_output"]

_KINDS = ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a named pipe (FIFO)"),
          (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a device"), (stat.S_ISBLK, "a device"))


def _what_it_is(mode: int) -> str | None:
    """What a path that exists is, when it is not a regular file; None for a regular file."""
    return next((name for test, name in _KINDS if test(mode)), None if stat.S_ISREG(mode) else "not a regular file")


def _folder_of(path: Path) -> Path:
    return path.parent if str(path.parent) else Path(".")


def check_output(path: Path, option: str = "--out", *, example: str = "out.json", replace: bool = True,
                 folder: bool = False) -> Path:
    """Refuse ``path`` as an output unless it is a regular file (``replace``: may be replaced) or a new name in an
    existing folder this user can write; with ``folder``, an existing real folder is taken instead of a file.

    ConfigError (exit 2) names ``option``, the path and the fix. Call it before anything is written: render calls
    it before it makes the run folder."""
    fix = f"name a regular file or a new file in an existing folder, like {example}"
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        info = None
    except OSError as error:  # a file where a folder should be (ENOTDIR), a name too long, no permission
        raise ConfigError(option, f"{path} cannot be used ({error.strerror or error})", fix) from None
    if info is not None:
        kind = _what_it_is(info.st_mode)
        if kind and not (folder and kind == "a folder"):
            raise ConfigError(option, f"{path} is {kind}", fix)
        if folder and kind is None:
            raise ConfigError(option, f"{path} is a file", f"name a new folder, like {example}")
        if not replace:
            raise ConfigError(option, f"{path} already exists", "pick another name, or pass --force to replace it")
    _check_folder(_folder_of(path), option)
    return path


def _check_folder(parent: Path, option: str) -> None:
    """The folder an output goes into must exist (a link to a folder is fine: it is yours to name) and be writable."""
    try:
        info = os.stat(parent)
    except OSError:
        raise ConfigError(option, f"the folder {parent} does not exist",
                          f"create it first (mkdir -p {parent}) or write into an existing folder") from None
    if not stat.S_ISDIR(info.st_mode):
        raise ConfigError(option, f"{parent} is not a folder", "write into an existing folder")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(option, f"the folder {parent} is not writable for you", "pick a folder you can write")


@contextlib.contextmanager
def open_output(path: Path, mode: int = 0o644) -> Iterator[BinaryIO]:
    """A binary handle on a new temporary file beside ``path``; when the block ends without an exception the file
    is fsynced, given ``mode`` and renamed over ``path``, else removed. Check ``path`` with :func:`check_output`
    first: this opens nothing but the temporary file, so a FIFO or device at ``path`` is never opened."""
    parent = _folder_of(path)
    tmp = parent / f".{path.name[:180]}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    descriptor = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0),
                         0o600)
    try:
        with open(descriptor, "wb") as handle:
            yield handle
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(tmp, _mode_for(path, mode))
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    _fsync_folder(parent)


def _mode_for(path: Path, mode: int) -> int:
    """The mode of the file replaced (a 0600 output stays 0600), else ``mode`` less the umask, as a plain
    ``open`` would make it (a umask of 077 keeps outputs private)."""
    with contextlib.suppress(OSError):
        info = os.lstat(path)
        if stat.S_ISREG(info.st_mode):
            return stat.S_IMODE(info.st_mode)
    umask = os.umask(0)
    os.umask(umask)
    return mode & ~umask


def write_output(path: Path, data: str | bytes, mode: int = 0o644) -> None:
    """``data`` (text as UTF-8) written to ``path`` through :func:`open_output`: all of it, or nothing."""
    with open_output(path, mode) as handle:
        handle.write(data.encode("utf-8") if isinstance(data, str) else data)


def _fsync_folder(folder: Path) -> None:
    """Make the rename durable; a file system that cannot fsync a folder loses nothing we could save."""
    with contextlib.suppress(OSError):
        descriptor = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        try:
            os.fsync(descriptor)
        finally:
            os.close(descriptor)
