"""One log per node: the ranks of a node append their records to one file, each line carrying its rank.

Why: a log per rank is 16,384 files in one folder at 16,384 ranks, each created and opened on the metadata
server of the shared file system; NVIDIA's resiliency tools and Monarch moved to one log per host for that
reason. The ranks of node K of the layout (ranks ``K*T .. K*T+T-1`` with ``T`` tasks per node) write
``logs/ranks-FIRST-LAST.log``, a name that says which ranks it holds, so a reader finds a rank's file from the
folder's listing alone. Each record is one ``write()`` on an ``O_APPEND`` descriptor: records of different ranks
never mix mid-record. The writers of one file are the processes of one node, one client of the file system (an
append from several clients is not atomic on NFS, which is why the file is per node and not per job).

Each record's first line is ``TIME rankN LEVEL message`` (:mod:`hpc_train.run.loglines`); the lines after it (a
traceback) belong to it. Older run folders hold ``rank-N.log``, one rank each: readers take both.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
from collections.abc import Iterable, Iterator
from pathlib import Path

from hpc_train.run.files import folder_names, open_run_path, read_record_text, write_all
from hpc_train.run.loglines import RANK_RECORD
from hpc_train.run.node_span import span_name, span_of
from hpc_train.run.paths import LOGS_DIR

__all__ = ["NodeLogHandler", "log_ranks", "node_log_name", "node_log_path", "rank_lines", "rank_log_names",
           "rank_log_text", "ranks_per_log", "split_by_rank"]

_RANK_LOG = re.compile(r"rank-([0-9]{1,9})\.log")  # one rank's log, as older versions wrote it
_WRITE_FLAGS = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC


def node_log_name(rank: int, per_node: int) -> str:
    """The name of the log that holds ``rank`` when ``per_node`` ranks share a node: ``ranks-4-7.log``."""
    return span_name("ranks", rank, per_node, ".log")


def ranks_per_log(rank: int, local_rank: int, per_node: int) -> int:
    """``per_node`` where the rank's place on its node is its place in the layout (``rank % per_node``, as srun's
    default block distribution, torchrun and mpirun place ranks), else 1: a rank placed otherwise (a cyclic
    distribution in the site's environment) writes a log of its own, so that no log is appended to from two
    nodes, which the shared file system does not make atomic."""
    return per_node if per_node > 0 and rank % per_node == local_rank else 1


def node_log_path(run_dir: Path, rank: int, per_node: int) -> Path:
    return Path(run_dir) / LOGS_DIR / node_log_name(rank, per_node)


def log_ranks(name: str) -> range | None:
    """The ranks a log's name says it holds (a node's log, or one rank's log of an older version); None for any
    other name."""
    if (held := span_of(name, "ranks", ".log")) is not None:
        return held
    if m := _RANK_LOG.fullmatch(name):
        return range(int(m[1]), int(m[1]) + 1)
    return None


def rank_log_names(names: Iterable[str], rank: int) -> list[str]:
    """The logs among ``names`` (a listing of ``logs/``) that hold ``rank``: its node's, and a one-rank log an
    older version wrote into the same run folder."""
    return sorted((name for name in names if (held := log_ranks(name)) is not None and rank in held),
                  key=lambda name: (name.startswith("rank-"), name))


class NodeLogHandler(logging.Handler):
    """A :class:`logging.Handler` that appends each record to a node's log in one ``write()``, opened through the
    run folder's no-link walk (:func:`~hpc_train.run.files.open_run_path`): neither the file nor ``logs/`` may be
    a link."""

    def __init__(self, path: Path) -> None:
        super().__init__()
        self.path = path
        self._fd: int | None = open_run_path(path, _WRITE_FLAGS, 0o600)  # no link at the file or logs/

    def emit(self, record: logging.LogRecord) -> None:
        try:
            data = (self.format(record) + "\n").encode("utf-8", errors="replace")
            with self.lock or contextlib.nullcontext():
                if self._fd is None:
                    return
                write_all(self._fd, data)
        except Exception:  # logging's own rule: a failed log line never ends the program
            self.handleError(record)

    def close(self) -> None:
        with self.lock or contextlib.nullcontext():
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None
        super().close()


def split_by_rank(lines: Iterable[str], default: int | None = None) -> Iterator[tuple[int | None, str]]:
    """(rank, line) for each line of a node's log: a record's first line names its rank, the lines after it are
    its rank's too; lines before the first record get ``default`` (the rank of a one-rank log)."""
    rank = default
    match = RANK_RECORD.match
    for line in lines:
        if line[:1].isdigit() and (m := match(line)) and len(m[2]) <= 9:
            rank = int(m[2])
        yield rank, line


def rank_lines(text: str, rank: int, holds: range | None = None) -> list[str]:
    """The lines of ``rank``'s records in a log's text (``holds``: the ranks the file's name says it holds; a
    one-rank log's lines are all that rank's)."""
    default = rank if holds is not None and len(holds) == 1 else None
    return [line for owner, line in split_by_rank(text.splitlines(), default) if owner == rank]


def rank_log_text(run_dir: Path, rank: int) -> str:
    """Rank ``rank``'s lines in the run folder's logs (its node's log; an older one-rank log first), each file
    read as every run-folder record is: never through a link, bounded in size."""
    logs = Path(run_dir) / LOGS_DIR
    lines: list[str] = []
    for name in sorted(rank_log_names(folder_names(logs), rank), key=lambda name: not name.startswith("rank-")):
        lines += rank_lines(read_record_text(logs / name), rank, log_ranks(name))
    return "".join(line + "\n" for line in lines)
