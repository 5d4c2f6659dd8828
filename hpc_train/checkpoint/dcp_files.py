"""DCP's shard files through hpc_train's own file handling: hashed while written, checked while read.

Why: a checkpoint's manifest holds each file's size and sha256. DCP writes and reads its ``__R_N.distcp`` shards
itself, so without this rank 0 read every shard back at commit to hash it (on 2 ranks an FSDP2 save took 4 times
as long as raw writes of the same bytes, ``benchmarks/checkpoint.py --engine fsdp2``), and a load with
``checkpoint.verify = "sha256"`` hashed every shard in a pass of its own before DCP read it again. Here each shard
goes through :class:`hpc_train.checkpoint.writer.HashingFile` (the DeepSpeed path's writer: hashed on the way,
writeback started block by block), created as a new private file that is never a link, and its manifest entry
joins the rank's own; a load reads each shard straight into its tensors (:mod:`hpc_train.checkpoint.verified_read`:
never through a link, its size and sha256 checked on the way) and keeps what it found wrong for the ranks to agree
on. DCP's
small ``.metadata`` is hashed at commit and read as DCP reads it.
"""

from __future__ import annotations

import os
from collections.abc import Generator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem

from hpc_train.checkpoint.manifest import FileEntry
from hpc_train.checkpoint.verified_read import verified
from hpc_train.checkpoint.writer import HashingFile

__all__ = ["checking_reader", "hashing_writer", "host_stager"]

SHARD_SUFFIX = ".distcp"


class _ShardStream(HashingFile):
    """What DCP writes a shard into: the hashing file, with the ``fileno`` DCP fsyncs and a ``close`` that leaves
    the descriptor to the file system below (DCP closes the stream inside the ``with`` that opened it)."""

    def fileno(self) -> int:
        return self.descriptor

    def close(self) -> None:
        """The descriptor is closed by :meth:`_HashingFileSystem.create_stream` once the entry is made."""


class _HashingFileSystem(FileSystem):
    """DCP's local file system; a shard opened for writing is hashed and listed in ``entries``, with its path
    relative to ``folder`` (the step folder)."""

    def __init__(self, folder: Path, entries: list[FileEntry]) -> None:
        super().__init__()
        self.folder = Path(os.path.abspath(folder))
        self.entries = entries

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Generator[Any, None, None]:
        path = Path(path)
        if mode != "wb" or path.suffix != SHARD_SUFFIX:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            sink = _ShardStream(descriptor)
            yield sink
        finally:
            os.close(descriptor)
        relative = Path(os.path.abspath(path)).relative_to(self.folder).as_posix()
        self.entries.append(FileEntry(path=relative, size=sink.size, sha256=sink.digest.hexdigest()))


def hashing_writer(where: Path, folder: Path, entries: list[FileEntry]) -> FileSystemWriter:
    """A DCP storage writer into ``where`` whose shards are fsynced (DCP's ``sync_files``) and hashed into
    ``entries`` as manifest entries relative to ``folder``."""
    writer = FileSystemWriter(str(where), sync_files=True)
    writer.fs = _HashingFileSystem(folder, entries)
    return writer


def host_stager(on_gpu: bool) -> Any:
    """What copies the state to host memory in an asynchronous save. Why not the writer's own staging (DCP's
    default once a storage writer is given, since the writer is also a stager): it measured twice as long a stall
    here as this, DCP's default stager when no writer is given. Pinned host memory on a GPU, for the copy."""
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    return DefaultStager(StagingOptions(use_pinned_memory=on_gpu, use_shared_memory=False, use_async_staging=False,
                                        use_non_blocking_copy=False))


class _CheckingFileSystem(FileSystem):
    """DCP's local file system; a shard opened for reading is read straight into the tensors DCP makes of it and
    checked against its manifest entry (relative to ``folder``) on the way (:mod:`hpc_train.checkpoint.
    verified_read`). A wrong sha256 goes into ``problems`` and the load goes on: its collectives must be reached by
    every rank, which then agree."""

    def __init__(self, folder: Path, entries: list[FileEntry], check_sha256: bool, problems: list[str]) -> None:
        super().__init__()
        self.folder = Path(os.path.abspath(folder))
        self.entries = {entry.path: entry for entry in entries}
        self.check_sha256 = check_sha256
        self.problems = problems

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Generator[Any, None, None]:
        path = Path(path)
        if mode != "rb" or path.suffix != SHARD_SUFFIX:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        relative = Path(os.path.abspath(path)).relative_to(self.folder).as_posix()
        entry = self.entries.get(relative)
        if entry is None:
            self.problems.append(f"{relative} is not in the manifest")
        with verified(path, entry, self.check_sha256) as shard:
            yield shard
            if not shard.finish():
                self.problems.append(f"{relative} is corrupt: sha256 differs from the manifest")


def checking_reader(where: Path, folder: Path, entries: list[FileEntry], check_sha256: bool,
                    problems: list[str]) -> FileSystemReader:
    """A DCP storage reader of ``where`` whose shards are checked against ``entries`` (manifest entries relative
    to ``folder``) as they are read, sha256 too when ``check_sha256``; what is wrong goes into ``problems``."""
    reader = FileSystemReader(str(where))
    reader.fs = _CheckingFileSystem(folder, entries, check_sha256, problems)
    return reader
