"""One log per node (issue 38): its name says which ranks it holds, each record is one append, and a rank's lines
are found again by the rank each record names."""

from __future__ import annotations

import logging
import multiprocessing
import os
from pathlib import Path

import pytest

from hpc_train.run.loglines import rank_log_format
from hpc_train.run.node_log import (
    NodeLogHandler,
    log_ranks,
    node_log_name,
    node_log_path,
    rank_lines,
    rank_log_names,
    rank_log_text,
    split_by_rank,
)


def test_the_name_of_a_node_s_log_names_its_ranks() -> None:
    assert [node_log_name(rank, 4) for rank in (0, 3, 4, 7, 16383)] == [
        "ranks-0-3.log", "ranks-0-3.log", "ranks-4-7.log", "ranks-4-7.log", "ranks-16380-16383.log"]
    assert node_log_name(5, 1) == "ranks-5-5.log" and node_log_name(5, 0) == "ranks-5-5.log"
    assert node_log_path(Path("/r"), 9, 8) == Path("/r/logs/ranks-8-15.log")
    assert log_ranks("ranks-4-7.log") == range(4, 8) and log_ranks("rank-9.log") == range(9, 10)
    for other in ("ranks-7-4.log", "ranks-1-2.log.bak", "rank-1.error.json", "stacks-rank-1.txt",
                  "agents-0-3.log", f"ranks-0-{'9' * 5000}.log", "ranks--1-2.log"):
        assert log_ranks(other) is None, other
    names = ["ranks-0-3.log", "rank-2.log", "ranks-4-7.log", "rank-2.error.json"]
    assert rank_log_names(names, 2) == ["ranks-0-3.log", "rank-2.log"] and rank_log_names(names, 9) == []


def _node_log(path: Path, rank: int, records: int) -> None:
    """A rank process of a node: ``records`` records of several lines each, the last a long traceback."""
    logger = logging.getLogger(f"test_node_log.rank{rank}")
    logger.propagate = False
    logger.setLevel(logging.INFO)
    handler = NodeLogHandler(path)
    handler.setFormatter(logging.Formatter(rank_log_format(rank)))
    logger.addHandler(handler)
    for index in range(records):
        body = "\n".join(f"  line {line} of record {index} of rank {rank}" for line in range(40))
        logger.info("record %d of rank %d\n%s", index, rank, body + "x" * (20_000 if index % 7 == 0 else 0))
    handler.close()


def test_the_ranks_of_a_node_append_whole_records_that_never_mix(tmp_path: Path) -> None:
    """Four processes append to one file at once, records of up to 20 kB (past any stdio buffer); every record's
    lines stay together under the record's first line."""
    (tmp_path / "logs").mkdir()
    path = node_log_path(tmp_path, 0, 4)
    context = multiprocessing.get_context("fork")
    workers = [context.Process(target=_node_log, args=(path, rank, 60)) for rank in range(4)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(60)
        assert worker.exitcode == 0
    assert os.stat(path).st_mode & 0o777 == 0o600
    lines = path.read_text().splitlines()
    assert len(lines) == 4 * 60 * 41
    for owner, line in split_by_rank(lines):
        assert owner is not None and (f"of rank {owner}" in line), line[:80]
    for rank in range(4):
        mine = rank_lines(path.read_text(), rank, range(0, 4))
        assert len(mine) == 60 * 41 and mine[0].endswith(f"rank{rank} INFO record 0 of rank {rank}")
        assert rank_log_text(tmp_path, rank).splitlines() == mine


def test_a_link_planted_where_the_log_goes_is_refused(tmp_path: Path) -> None:
    (tmp_path / "logs").mkdir()
    (tmp_path / "elsewhere").write_text("precious\n")
    node_log_path(tmp_path, 0, 2).symlink_to(tmp_path / "elsewhere")
    with pytest.raises(OSError):
        NodeLogHandler(node_log_path(tmp_path, 0, 2))
    assert (tmp_path / "elsewhere").read_text() == "precious\n"
    run = tmp_path / "run"  # logs/ itself a link: nothing is written through it either
    run.mkdir()
    (tmp_path / "other").mkdir()
    (run / "logs").symlink_to(tmp_path / "other")
    with pytest.raises(OSError):
        NodeLogHandler(node_log_path(run, 0, 2))
    assert list((tmp_path / "other").iterdir()) == []


def test_a_rank_s_lines_from_an_older_one_rank_log_and_its_node_s_log(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "rank-1.log").write_text("a line before any record\n2026-01-01 00:00:00,000 rank1 INFO old\n")
    (logs / "ranks-0-1.log").write_text("2026-01-01 00:00:01,000 rank0 INFO zero\n"
                                        "2026-01-01 00:00:02,000 rank1 ERROR new\nTraceback (most recent call last):\n"
                                        "2026-01-01 00:00:03,000 rank0 INFO zero again\n")
    assert rank_log_text(tmp_path, 1).splitlines() == [
        "a line before any record", "2026-01-01 00:00:00,000 rank1 INFO old",
        "2026-01-01 00:00:02,000 rank1 ERROR new", "Traceback (most recent call last):"]
    assert rank_log_text(tmp_path, 0).count("zero") == 2 and rank_log_text(tmp_path, 5) == ""
    (logs / "ranks-2-3.log").symlink_to(logs / "ranks-0-1.log")
    assert rank_log_text(tmp_path, 2) == ""  # never read through a link
