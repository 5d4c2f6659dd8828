"""Checkpoint files that pass through memory once: hashed while written, read back never, read once to load.

Why: sealing a checkpoint used to read every file back to hash it (a quarter of a save) and a sha256 resume read
every file twice (once to verify, once to load). :class:`HashingFile` is the file object a serializer
(``torch.save``) writes into: each block is hashed and written straight to the descriptor, and the kernel is
asked to start writing it back to the disk at once (``sync_file_range``), so the disk works while the next
block is serialized and hashed and the final ``fsync`` finds little left to do. :func:`write_file` returns the
:class:`~hpc_train.checkpoint.manifest.FileEntry` the manifest needs; a load reads a file once, checking its size
and (when asked) its sha256 against the manifest (:mod:`hpc_train.checkpoint.verified_read`).

No torch import: the manager and the login-node commands share this module.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import hashlib
import io
import os
import stat
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from hpc_train.checkpoint.manifest import FileEntry
from hpc_train.run.files import write_all

__all__ = ["BLOCK", "HASHER", "HashingFile", "VerifyError", "ViewReader", "checked_size", "write_file"]

BLOCK = 8 << 20  # hashed and handed to the kernel in blocks this size: flat memory, full disk bandwidth
_SYNC_FILE_RANGE_WRITE = 2  # start writeback of the range, do not wait for it (linux/fs.h)
_OVERLAP_FROM = 2 * BLOCK  # writes this large hash in a thread beside the write; small ones hash inline
HASHER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-sha256")


class VerifyError(Exception):
    """A file that does not match its manifest entry (size or sha256); the message names the file."""


def _sync_file_range() -> Callable[[int, int, int, int], int] | None:
    """libc's ``sync_file_range`` (Linux), or None where there is none: writeback then starts at ``fsync``."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        function = libc.sync_file_range
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    function.restype = ctypes.c_int
    return function


_START_WRITEBACK = _sync_file_range()


class HashingFile:
    """A write-only binary file object over a descriptor: every byte written is hashed on the way, and written
    back to the disk as soon as a block is complete. ``torch.save`` and ``safetensors`` write into it."""

    def __init__(self, descriptor: int) -> None:
        self.descriptor = descriptor
        self.digest = hashlib.sha256()
        self.size = 0
        self._flushed = 0  # bytes already handed to writeback

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        hashing: Future[None] | None = None
        for start in range(0, len(view), BLOCK):
            block = view[start:start + BLOCK]
            if len(view) < _OVERLAP_FROM:
                self.digest.update(block)
            else:  # hash this block in the hasher thread while it is written here (both drop the GIL)
                if hashing is not None:
                    hashing.result()
                hashing = HASHER.submit(self.digest.update, block)
            write_all(self.descriptor, block)
            self.size += len(block)
            if _START_WRITEBACK is not None and self.size - self._flushed >= BLOCK:
                _START_WRITEBACK(self.descriptor, self._flushed, self.size - self._flushed, _SYNC_FILE_RANGE_WRITE)
                self._flushed = self.size
        if hashing is not None:
            hashing.result()  # the caller may reuse ``data`` once this returns
        return len(view)

    def flush(self) -> None:
        """Nothing is buffered here: every write went to the descriptor."""

    def writable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.size


def write_file(folder: Path, relative: str, fill: Callable[[HashingFile], None]) -> FileEntry:
    """Create ``folder/relative`` (a new private file; an existing name or a link is an error), let ``fill``
    write into it, fsync it and return its manifest entry. The size and hash are of the bytes written, so a file
    changed on disk afterwards no longer matches its entry."""
    path = folder / relative
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        sink = HashingFile(descriptor)
        fill(sink)
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
    return FileEntry(path=relative, size=sink.size, sha256=sink.digest.hexdigest())


def checked_size(path: Path, descriptor: int, entry: FileEntry | None) -> int:
    """The size of the file open on ``descriptor``; VerifyError where it is not a regular file or its size is not
    ``entry``'s."""
    info = os.fstat(descriptor)
    if not stat.S_ISREG(info.st_mode):
        raise VerifyError(f"{path} is not a regular file")
    if entry is not None and info.st_size != entry.size:
        kind = "short (truncated)" if info.st_size < entry.size else "long"
        raise VerifyError(f"{path} is {kind}: {info.st_size} bytes, manifest says {entry.size}")
    return info.st_size


class ViewReader(io.RawIOBase):
    """A seekable binary file over bytes already in memory, read with ``readinto`` so that ``torch.load`` copies
    each record once, into its tensor (``io.BytesIO`` would first copy the whole file)."""

    def __init__(self, view: memoryview) -> None:
        super().__init__()
        self.view = view
        self.position = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, target: Any) -> int:
        count = max(0, min(len(target), len(self.view) - self.position))
        memoryview(target).cast("B")[:count] = self.view[self.position:self.position + count]
        self.position += count
        return count

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.position, io.SEEK_END: len(self.view)}[whence]
        self.position = base + offset
        return self.position

    def tell(self) -> int:
        return self.position
