"""A node's error records in one file (hpc_train.run.error_log), and every reader of error records taking them:
the follower, the cancel policy, ``status``, ``logs --errors-only``, the failure classes' evidence, the look-back."""

from __future__ import annotations

import json
import multiprocessing
import os
from pathlib import Path

import pytest

from hpc_train.run.error_log import (
    CONSEQUENCES,
    append_error,
    error_log_name,
    error_log_ranks,
    error_logs,
    node_error_records,
    read_error_log,
)


def _record(rank: int, error: str = "RuntimeError('NCCL error: unhandled system error')", **more: object) -> dict:
    return {"rank": rank, "host": f"n{rank // 4}", "time": 1000.0 + rank, "job_id": "7", "restart": 0,
            "error": error, "traceback": f"Traceback...\n{error}\n", **more}


def _folder(tmp_path: Path) -> Path:
    (tmp_path / "logs").mkdir(mode=0o700)
    return tmp_path


def test_names_say_which_ranks_a_node_file_holds() -> None:
    assert error_log_name(5, 4) == "errors-4-7.jsonl"
    assert error_log_name(5, 4, CONSEQUENCES) == "consequences-4-7.jsonl"
    assert error_log_ranks("errors-4-7.jsonl") == range(4, 8)
    assert error_log_ranks("prev-errors-4-7.jsonl") == range(4, 8)
    for other in ("errors-7-4.jsonl", "errors-0-99999.jsonl", "consequences-4-7.jsonl", "rank-4.error.json",
                  "errors-4-7.jsonl.tmp", "../errors-4-7.jsonl"):
        assert error_log_ranks(other) is None, other
    names = ["errors-0-3.jsonl", "prev-errors-4-7.jsonl", "ranks-0-3.log"]
    assert error_logs(names) == ["errors-0-3.jsonl"] and error_logs(names, kept=True) == ["prev-errors-4-7.jsonl"]


def _append_many(run_dir: str, rank: int) -> None:
    for number in range(50):
        append_error(Path(run_dir), "errors-0-3.jsonl", _record(rank, f"RuntimeError('try {number} ' + 'x' * 5000)"))


def test_the_ranks_of_a_node_append_at_once_and_no_record_is_torn(tmp_path: Path) -> None:
    run_dir = _folder(tmp_path)
    procs = [multiprocessing.get_context("fork").Process(target=_append_many, args=(str(run_dir), rank))
             for rank in range(4)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(60)
    lines = (run_dir / "logs" / "errors-0-3.jsonl").read_text().splitlines()
    assert len(lines) == 200 and all(json.loads(line)["rank"] in range(4) for line in lines)
    newest = read_error_log(run_dir / "logs" / "errors-0-3.jsonl")
    assert sorted(newest) == [0, 1, 2, 3] and all("try 49" in r["error"] for r in newest.values())
    assert oct((run_dir / "logs" / "errors-0-3.jsonl").stat().st_mode & 0o777) == "0o600"


def test_a_long_traceback_keeps_its_end_and_damage_is_skipped(tmp_path: Path) -> None:
    run_dir = _folder(tmp_path)
    append_error(run_dir, "errors-0-1.jsonl", _record(0, traceback="frame\n" * 200_000 + "TheError: here\n"))
    path = run_dir / "logs" / "errors-0-1.jsonl"
    with path.open("a") as out:
        out.write('{"rank": 5, "error": "not this node\'s"}\nnot json\n{"rank": true}\n{"rank": 1, "error": "t')
    records = read_error_log(path)
    assert list(records) == [0], records  # rank 5 is not the file's, the last line is torn
    assert records[0]["traceback"].endswith("TheError: here\n") and len(records[0]["traceback"]) < 300_000


def test_a_record_too_large_for_a_line_is_cut_not_lost(tmp_path: Path) -> None:
    """A 1.1 MB error and a traceback of wide characters (6 bytes each once escaped): the line still fits what
    every reader takes (1 MiB), keeping the texts' ends."""
    run_dir = _folder(tmp_path)
    append_error(run_dir, "errors-0-3.jsonl", _record(0, "RuntimeError('" + "x" * 1_100_000 + " the end')"))
    append_error(run_dir, "errors-0-3.jsonl", _record(1, traceback="\u2603" * 200_000 + "\nKeyError: 'snow'\n"))
    append_error(run_dir, "errors-0-3.jsonl", _record(2))
    records = read_error_log(run_dir / "logs" / "errors-0-3.jsonl")
    assert sorted(records) == [0, 1, 2]
    assert records[0]["error"].endswith(" the end')") and records[1]["traceback"].endswith("KeyError: 'snow'\n")
    assert all(len(line) < 1 << 20 for line in (run_dir / "logs" / "errors-0-3.jsonl").read_bytes().splitlines())


def test_the_file_is_never_reached_through_a_link(tmp_path: Path) -> None:
    run_dir = _folder(tmp_path)
    elsewhere = tmp_path / "elsewhere.jsonl"
    elsewhere.write_text("")
    os.symlink(elsewhere, run_dir / "logs" / "errors-0-1.jsonl")
    with pytest.raises(OSError):
        append_error(run_dir, "errors-0-1.jsonl", _record(0))
    assert elsewhere.read_text() == ""
    assert read_error_log(run_dir / "logs" / "errors-0-1.jsonl") == {}


def test_every_reader_takes_the_nodes_files(tmp_path: Path) -> None:
    """Ranks 0-3 on node n0 and 4-7 on n1 failed alike after rank 5's fault; rank 2 wrote an older per-rank file
    (a run folder of an earlier version): the follower, the cancel policy, logs, status and the evidence see all."""
    from hpc_train.failures.evidence import collect_evidence
    from hpc_train.login.ops.logs import _rank_errors
    from hpc_train.login.slurm.cancel_policy import read_failures
    from hpc_train.login.slurm.follow import ErrorRecords
    from hpc_train.run.error_records import clear_kept, ranks_with_records

    run_dir = _folder(tmp_path)
    for rank in (0, 1, 3, 4, 5, 6, 7):
        append_error(run_dir, error_log_name(rank, 4), _record(rank, "RuntimeError('Connection closed by peer')"
                                                               if rank != 5 else "RuntimeError('NCCL WARN xid 79')"))
    (run_dir / "logs" / "rank-2.error.json").write_text(json.dumps(_record(2)))
    expected = list(range(8))
    assert sorted(r["rank"] for r in read_failures(run_dir)) == expected
    follower = ErrorRecords(run_dir)
    assert sorted(r["rank"] for r in follower.read()) == expected
    append_error(run_dir, error_log_name(0, 4), _record(0, "RuntimeError('again')"))  # the file grew: read again
    assert [r["error"] for r in follower.read() if r["rank"] == 0] == ["RuntimeError('again')"]
    assert sorted(r["rank"] for r in node_error_records(run_dir / "logs", os.listdir(run_dir / "logs"))) == \
        [0, 1, 3, 4, 5, 6, 7]
    shown = _rank_errors(run_dir / "logs", None)
    assert sorted(rank for error in shown for rank in [error.rank, *error.same_ranks]) == expected
    assert [e.rank for e in _rank_errors(run_dir / "logs", 5)] == [5]
    evidence = collect_evidence(run_dir, "7", 0)
    assert {r.rank: r.error for r in evidence.ranks}[5] == "RuntimeError('NCCL WARN xid 79')"
    assert ranks_with_records(run_dir) == expected
    (run_dir / "logs" / "errors-4-7.jsonl").rename(run_dir / "logs" / "prev-errors-4-7.jsonl")  # kept aside
    assert ranks_with_records(run_dir) == expected
    assert "NCCL WARN" in {r.rank: r.error for r in collect_evidence(run_dir, "7", 0, ranks=[5]).ranks}[5]
    assert 5 not in {r["rank"] for r in read_failures(run_dir)}  # kept aside: not this attempt's failure
    assert clear_kept(run_dir) == 1 and not (run_dir / "logs" / "prev-errors-4-7.jsonl").exists()
