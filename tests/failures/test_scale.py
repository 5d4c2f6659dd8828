"""The login side at scale (issue 38), without a clock: a run folder where every rank wrote an error costs each
reader a number of operations linear in ranks. Counted here: records built while merging identical errors, files
opened, the failure patterns run, and the look-back reading only the ranks that failed. (The wall times are
benchmarks/control_plane.py's.)"""

from __future__ import annotations

import io
import json
import os
from datetime import datetime
from pathlib import Path

import pytest
from rich.console import Console

from hpc_train.backends.scheduler import SchedulerAnswer
from hpc_train.common.terminal import ranges
from hpc_train.failures import classify as classify_module
from hpc_train.failures import evidence as evidence_module
from hpc_train.failures.classify import classify
from hpc_train.failures.evidence import collect_evidence
from hpc_train.failures.records import open_bytes, read_tail, stamp_time
from hpc_train.login.ops import logs as logs_module
from hpc_train.login.ops import status
from hpc_train.login.slurm import follow
from hpc_train.login.slurm.cancel_policy import read_facts, read_failures
from hpc_train.run.files import read_record_text
from tests.failures.fixtures import (
    T0,
    Rank,
    comm_traceback,
    record,
    traceback_text,
    write_attempts,
    write_plan,
    write_rank,
)

ROOT = "RuntimeError('NCCL error: unhandled system error, NCCL version 2.21.5 NET/IB : Got completion from peer')"


def _peer_gone(rank: int) -> str:
    return f"DistBackendError('[Rank {rank}] NCCL communicator was aborted on rank {rank}: ncclRemoteError')"


def _cascade(run_dir: Path, world: int, root: int, logs: bool = True, silent: tuple[int, ...] = ()) -> None:
    """Job 88 of ``world`` ranks on nodes of 4: ``root`` raised an NCCL system error, every other rank (but
    ``silent``) lost its peer after it."""
    write_plan(run_dir)
    write_attempts(run_dir, [{"job_id": "88", "started": T0, "outcome": "failed"}])
    folder = run_dir / "logs"
    for rank in range(world):
        error = "" if rank in silent else ROOT if rank == root else _peer_gone(rank)
        trace = comm_traceback(f"RuntimeError: {error}") if error else ""
        at = 5.0 if rank == root else 6.0 + rank / world
        if logs:
            write_rank(run_dir, "88", Rank(rank, rank // 4, error=error, traceback=trace, error_at=at), world=world,
                       nodes=world // 4, host=f"n{rank // 4}")
        elif error:
            report = {"rank": rank, "host": f"n{rank // 4}", "time": T0 + at, "error": error, "traceback": trace}
            (folder / f"rank-{rank}.error.json").write_text(json.dumps(report))


# -- logs: identical errors folded once ----------------------------------------------------------------------


def test_16384_identical_errors_fold_into_one_record_listing_ranks_as_ranges(tmp_path: Path,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    _cascade(tmp_path, 16384, root=5000, logs=False)
    built: list[int] = []

    class Counted(logs_module.RankError):
        def __post_init__(self) -> None:
            built.append(self.rank)

    monkeypatch.setattr(logs_module, "RankError", Counted)
    view = logs_module.merged_view(tmp_path, errors_only=True)
    root, peers = view.errors
    assert root.rank == 5000 and root.same_ranks == ()
    assert peers.rank == 0 and peers.same_ranks == (*range(1, 5000), *range(5001, 16384))
    # one record per error file and one per folded group: merging copied nothing per rank (it once rebuilt the
    # record with its whole rank list for each identical error: 16,383 copies, quadratic in the list)
    assert len(built) <= 16384 + 2
    text = logs_module.format_text(view)
    assert "    the same error on rank 1-4999,5001-16383" in text.splitlines()
    assert len(text) < 2000


def test_error_records_of_many_ranks_name_them_as_ranges(tmp_path: Path) -> None:
    _cascade(tmp_path, 64, root=9)
    text = logs_module.format_text(logs_module.merged_view(tmp_path, errors_only=True))
    assert "(the same in ranks 1-8,10-63)" in text  # the peers' "failed:" records, folded into rank 0's


def test_logs_reads_each_file_once_and_parses_each_second_of_the_clock_once(tmp_path: Path,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    _cascade(tmp_path, 512, root=3)
    opened: list[str] = []
    real_open = logs_module.open_bytes
    monkeypatch.setattr(logs_module, "open_bytes", lambda path, *a, **k: opened.append(str(path)) or real_open(
        path, *a, **k))
    logs_module._second.cache_clear()
    logs_module.merged_view(tmp_path, errors_only=True, tail=20)
    assert len(opened) == len(set(opened)) == 512 // 4  # the nodes' logs; error records are read once each too
    assert logs_module._second.cache_info().misses <= 10  # every record's time stamp, parsed per second


# -- evidence and the failure classes ------------------------------------------------------------------------


def test_the_classifier_runs_its_patterns_on_the_first_failed_rank_only(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    _cascade(tmp_path, 4096, root=1234)
    diagnosed: list[int] = []
    real = classify_module._diagnose
    monkeypatch.setattr(classify_module, "_diagnose", lambda report: diagnosed.append(report.rank) or real(report))
    found = classify(record("88", "FAILED", nodes="n[0-1023]"), collect_evidence(tmp_path, "88", 0))
    assert found.failure_class == "infrastructure" and found.ranks == (1234,) and found.nodes == ("n308",)
    assert any(fact == "rank 0-1233,1235-4095 failed after it" for fact in found.evidence)
    assert diagnosed == [1234]  # the others' kinds never decide: each rank's text once was searched six times


def test_evidence_opens_each_rank_file_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _cascade(tmp_path, 1024, root=7)
    opened: list[str] = []
    real = evidence_module.read_tail, evidence_module.read_json
    monkeypatch.setattr(evidence_module, "read_tail", lambda path, limit: opened.append(path) or real[0](path, limit))
    monkeypatch.setattr(evidence_module, "read_json", lambda path: opened.append(path) or real[1](path))
    evidence = collect_evidence(tmp_path, "88", 0)
    assert len(evidence.ranks) == 1024
    assert len(opened) == len(set(opened)) == 1024 + 1024 // 4  # an error record per rank, a log per node


def test_status_reads_the_failed_attempt_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _cascade(tmp_path, 64, root=7)
    calls: list[tuple[object, ...]] = []
    real = status.collect_evidence
    monkeypatch.setattr(status, "collect_evidence", lambda *args: calls.append(args) or real(*args))
    [row], _ = status.collect([tmp_path], poll=lambda ids, dirs: SchedulerAnswer(False))
    assert row.state == "FAILED" and row.failure is not None and row.failure.failure_class == "infrastructure"
    assert row.attempts[0].failure == row.failure.to_dict()
    assert len(calls) == 1  # the run's failure and its attempt's line are the same attempt


# -- the follower ------------------------------------------------------------------------------------------


def test_the_follower_reads_each_error_record_once_across_polls(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    _cascade(tmp_path, 2048, root=99, logs=False)
    reads: list[str] = []
    real = follow._read_error
    monkeypatch.setattr(follow, "_read_error", lambda path, size: reads.append(path) or real(path, size))
    job = follow.FollowedJob(type("Job", (), {"job_id": "88"})(), tmp_path, submitted_at=T0, state="FAILED")
    first = job.rank_errors()
    assert first == read_failures(tmp_path, job.since)  # the same records, in the same order
    assert job.cancel_decision() == follow.decide_cancel(read_facts(tmp_path, "88", "FAILED", job.since))
    out = io.StringIO()
    follow._report_failure(Console(file=out, width=300), job)
    assert len(reads) == 2048  # three polls' worth of reading, each record once
    assert "(failed ranks: 0-2047)" in " ".join(out.getvalue().split())  # rich wraps the line
    (tmp_path / "logs" / "rank-3.error.json").write_text(json.dumps({"rank": 3, "time": T0 + 1, "error": "x"}))
    assert job.rank_errors()[0]["rank"] == 3 and len(reads) == 2049  # a rewritten record is read again


# -- the readers themselves ----------------------------------------------------------------------------------


def test_stamps_parse_to_the_same_seconds_as_strptime() -> None:
    for stamp in ("2026-11-30 03:15:30,123", "2026-03-29 02:30:00,999", "2026-10-25 02:59:59,000"):
        assert stamp_time(stamp) == datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").timestamp()
    assert stamp_time("2026-11-30 03:15:30") is None and stamp_time("2026-13-30 03:15:30,123") is None


def test_the_fast_reader_refuses_links_and_fifos_and_keeps_to_its_bounds(tmp_path: Path) -> None:
    target = tmp_path / "target.json"
    target.write_text("x" * 100 + "\nlast line\n")
    (tmp_path / "link.json").symlink_to(target)
    os.mkfifo(tmp_path / "fifo")
    for name in ("link.json", "fifo", "missing"):
        with pytest.raises(OSError):
            open_bytes(tmp_path / name)
    assert open_bytes(target, 10) == (b"x" * 10, 111)
    assert read_tail(target, 20) == "last line\n"  # the partial first line dropped
    assert read_tail(target, 1000) == read_record_text(target)


def test_ranges() -> None:
    assert ranges([5, 0, 1, 2, 2, 7, 8]) == "0-2,5,7-8" and ranges([]) == ""
    assert traceback_text([], "x")  # the fixtures' helper stays importable here
