"""The follower's reads of a run folder (issue 39): the rank-0 log it tails, the error records it polls and the
batch output it shows, never through a link below the run folder, never blocking on a FIFO, and never failing on a
record whose numbers or types are out of range."""

from __future__ import annotations

import io
import json
import os
import time
from pathlib import Path

import pytest
from rich.console import Console

from hpc_train.login.slurm import follow
from hpc_train.login.slurm.cancel_policy import read_failures

T0 = 1_796_000_000.0


def _job(run: Path) -> follow.FollowedJob:
    return follow.FollowedJob(type("Job", (), {"job_id": "7"})(), run, submitted_at=T0, state="FAILED")


def _report(job: follow.FollowedJob) -> str:
    out = io.StringIO()
    follow._report_failure(Console(file=out, width=300), job)
    return out.getvalue()


@pytest.fixture
def run(tmp_path: Path) -> Path:
    folder = tmp_path / "run"
    (folder / "logs").mkdir(parents=True)
    other = tmp_path / "other"
    other.mkdir()
    (other / "ranks-0-0.log").write_text("2026-01-01 00:00:00,000 rank0 INFO SECRET line\n")
    (other / "rank-0.error.json").write_text(json.dumps({"rank": 0, "time": T0 + 1, "error": "SECRET"}))
    (other / "slurm-7.err").write_text("SECRET batch\n")
    return folder


def test_a_logs_folder_that_is_a_link_gives_the_follower_nothing(run: Path) -> None:
    (run / "logs").rmdir()
    (run / "logs").symlink_to(run.parent / "other")
    job = _job(run)
    assert job.tail.new_lines() == [] and job.rank_errors() == [] and read_failures(run, 0.0) == []
    assert "SECRET" not in _report(job)


def test_linked_files_and_a_fifo_are_skipped_without_waiting(run: Path) -> None:
    for name in ("rank-0.error.json", "slurm-7.err"):
        (run / "logs" / name).symlink_to(run.parent / "other" / name)
    os.mkfifo(run / "logs" / "ranks-0-0.log")
    job = _job(run)
    start = time.monotonic()
    assert job.tail.new_lines() == [] and job.rank_errors() == []
    assert "SECRET" not in _report(job) and time.monotonic() - start < 2


def test_the_tailed_log_shows_escapes_as_text(run: Path) -> None:
    record = "2026-01-01 00:00:00,000 rank0 INFO step 1 \x1b[2J\x1b]0;retitled\x07\n"
    (run / "logs" / "ranks-0-0.log").write_text(record)
    lines = _job(run).tail.new_lines()
    assert "step 1" in "".join(lines) and "\x1b" not in "".join(lines)


def test_the_follower_shows_rank_0_s_records_of_its_node_s_log_and_whole_lines_only(run: Path) -> None:
    """Rank 0's lines, a traceback under its record included, never rank 1's; a record being written waits for
    the next poll."""
    log = run / "logs" / "ranks-0-1.log"
    log.write_text("2026-01-01 00:00:00,000 rank0 INFO start\n2026-01-01 00:00:00,100 rank1 ERROR boom\n"
                   "Traceback (most recent call last):\n  rank 1's frame\n"
                   "2026-01-01 00:00:01,000 rank0 ERROR failed\nTraceback (most recent call last):\n")
    job = follow.FollowedJob(type("Job", (), {"job_id": "7"})(), run, submitted_at=T0, tasks_per_node=2)
    assert job.tail.new_lines() == ["2026-01-01 00:00:00,000 rank0 INFO start",
                                    "2026-01-01 00:00:01,000 rank0 ERROR failed", "Traceback (most recent call last):"]
    with open(log, "a") as out:
        out.write("  rank 0's frame\n2026-01-01 00:00:02,000 rank1 INFO still here\n2026-01-01 00:00:03,000 rank0 IN")
    assert job.tail.new_lines() == ["  rank 0's frame"]
    with open(log, "a") as out:
        out.write("FO done\n")
    assert job.tail.new_lines() == ["2026-01-01 00:00:03,000 rank0 INFO done"]


@pytest.mark.parametrize("record", [{"rank": "x", "time": T0 + 1}, {"rank": "[/]", "time": T0 + 1},
                                    {"rank": [1], "time": T0 + 1}, {"rank": 1, "time": "1e308"},
                                    {"rank": -1, "time": T0 + 0.5, "error": "boom", "traceback": ["not", "text"]}])
def test_error_records_of_any_type_sort_and_report_without_failing(run: Path, record: dict) -> None:
    (run / "logs" / "rank-0.error.json").write_text(json.dumps({"rank": 0, "time": T0 + 1, "error": "boom"}))
    (run / "logs" / "rank-1.error.json").write_text(json.dumps({"time": T0 + 1, **record}))
    (run / "logs" / "rank-2.error.json").write_text('{"rank": 3, "time": ' + "1" + "0" * 400 + "}")
    job = _job(run)
    errors = job.rank_errors()
    assert errors == read_failures(run, job.since) and errors[0]["rank"] in (0, -1)
    assert "boom" in _report(job)
