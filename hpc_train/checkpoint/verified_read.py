"""A checkpoint file read straight into the tensors ``torch.load`` makes of it, hashed in the file's order on the way.

Why: a load read each file whole into a buffer (hashing it), and only then did ``torch.load`` copy its records out
of that buffer into tensors: the read, a second copy of every byte into fresh memory, and the deserialization one
after another (1.7x a raw read of the same files on this 2-core machine, ``benchmarks/checkpoint.py``). Here
``torch.load`` reads the file itself through :class:`VerifiedReader`: each record goes from the page cache into its
tensor in one copy, and sha256 follows the read in a second thread, block by block, as the file's bytes pass.

What ``torch.load`` reads out of order (the zip's directory at the end, which it reads first; records a DCP load
does not need) is hashed later, read again from the file (:meth:`VerifiedReader.finish`), so the digest always
covers the whole file in its order. A wrong size is refused before a byte is read. A wrong sha256 is known at
:meth:`VerifiedReader.finish`, after the bytes were deserialized (with ``weights_only=True``): the caller's load goes
on to its end (its collectives must be reached by every rank), then the ranks agree to give up on the checkpoint,
as they did when the whole file was read before it was deserialized. Every byte is read from a file that was
opened once, without following a link; a file changed on disk during its own load is outside what this checks.

No torch import: this module only moves bytes.
"""

from __future__ import annotations

import hashlib
import io
import os
from collections.abc import Iterator
from concurrent.futures import Future, wait
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from hpc_train.checkpoint.manifest import FileEntry
from hpc_train.checkpoint.writer import BLOCK, HASHER, VerifyError, checked_size

__all__ = ["GAP_FILL", "VerifiedReader", "verified"]

GAP_FILL = 1 << 20  # a read this close past the hashed bytes hashes the gap first (headers, a record skipped)


class VerifiedReader(io.RawIOBase):
    """A seekable binary file over ``path`` for ``torch.load``: each read goes from the file into the caller's
    buffer, and the bytes from the start of the file up to it are hashed (when ``check_sha256`` and an ``entry``)
    before the read returns. Opened without following a link; a file that is not regular or whose size is not
    ``entry``'s is refused at once with :class:`VerifyError`. Use it as a context manager, and call
    :meth:`finish` once the load is done for the file's verdict."""

    def __init__(self, path: Path, entry: FileEntry | None, check_sha256: bool) -> None:
        super().__init__()
        self.path = path
        self._descriptor = -1  # what close() finds if the open fails
        self._descriptor = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            self.size = checked_size(path, self._descriptor, entry)
        except BaseException:
            self.close()  # closed once: the finalizer must not close a number that may be another file's by then
            raise
        self._entry = entry
        self._digest = hashlib.sha256() if check_sha256 and entry is not None else None
        self._hashed = 0  # the bytes from the start up to here are in the digest
        self.position = 0
        self.failure: VerifyError | None = None  # the file shrank under a read (torch.load reports it its own way)

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        bases = {io.SEEK_SET: 0, io.SEEK_CUR: self.position, io.SEEK_END: self.size}
        if whence not in bases or bases[whence] + offset < 0:
            raise ValueError(f"cannot seek to {offset} from {whence} in {self.path}")
        self.position = bases[whence] + offset
        return self.position

    def tell(self) -> int:
        return self.position

    def readinto(self, target: Any) -> int:
        view = memoryview(target).cast("B")
        start, count = self.position, max(0, min(len(view), self.size - self.position))
        follows = self._digest is not None and start <= self._hashed < start + count
        if self._digest is not None and self._hashed < start <= self._hashed + GAP_FILL:
            self._hash_from_file(self._hashed, min(start, self.size))  # a header or a record skipped: hashed first
            follows = count > 0
        hashing: Future[None] | None = None
        done = 0
        try:
            while done < count:  # a block queued for the hasher while the next one is read
                got = os.preadv(self._descriptor, [view[done:min(count, done + BLOCK)]], start + done)
                if got == 0:
                    self.failure = VerifyError(f"{self.path} shrank while it was read ({start + done} of "
                                               f"{self.size} bytes)")
                    raise self.failure
                if follows and start + done + got > self._hashed:
                    hashing = HASHER.submit(self._digest.update, view[self._hashed - start:done + got])  # type: ignore
                    self._hashed = start + done + got
                done += got
        finally:  # the caller's buffer is its own again only once hashed: one worker, first in first out
            if hashing is not None:
                _wait_out(hashing)
        self.position += count
        return count

    def finish(self) -> bool:
        """Hash what the load did not read in order (read again from the file); True when the sha256 matches the
        entry (or none was asked for), False when it does not."""
        if self._digest is None or self._entry is None:
            return True
        self._hash_from_file(self._hashed, self.size)
        return self._digest.hexdigest() == self._entry.sha256

    def close(self) -> None:
        descriptor, self._descriptor = self._descriptor, -1
        try:
            if descriptor >= 0:
                os.close(descriptor)
        finally:
            super().close()

    def _hash_from_file(self, start: int, end: int) -> None:
        """Read the bytes from ``start`` to ``end`` (the hashed ones end at ``start``) and hash them."""
        scratch = memoryview(bytearray(min(BLOCK, max(0, end - start))))
        while start < end:
            got = os.preadv(self._descriptor, [scratch[:min(len(scratch), end - start)]], start)
            if got == 0:
                self.failure = VerifyError(f"{self.path} shrank while it was read ({start} of {self.size} bytes)")
                raise self.failure
            self._digest.update(scratch[:got])  # type: ignore[union-attr]
            start += got
        self._hashed = max(self._hashed, end)


def _wait_out(future: Future[None]) -> None:
    """Wait until ``future`` is done, even through an interrupt (a KeyboardInterrupt, raised again after): its work
    reads memory that its caller frees as the interrupt unwinds."""
    interrupted: BaseException | None = None
    while not future.done():
        try:
            wait([future])
        except BaseException as error:  # kept, and raised once the hash is done with the memory
            interrupted = error
    if interrupted is not None:
        raise interrupted
    future.result()


@contextmanager
def verified(path: Path, entry: FileEntry | None, check_sha256: bool) -> Iterator[VerifiedReader]:
    """``path`` as a :class:`VerifiedReader` for the block's use, closed after it. An error the block meets because
    the file shrank while it was read is raised as that VerifyError, not as what the deserializer made of it."""
    with VerifiedReader(path, entry, check_sha256) as reader:
        try:
            yield reader
        except Exception as error:
            if reader.failure is not None and reader.failure is not error:
                raise reader.failure from error
            raise
