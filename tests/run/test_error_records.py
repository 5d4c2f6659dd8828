"""The previous attempt's error records: listed once, and cleared by rank 0 without losing one of this attempt."""

from __future__ import annotations

import json
import os
from pathlib import Path

from hpc_train.run import error_records
from hpc_train.run.error_records import clear_stale_records, ranks_with_records, record_is_of


def _record(run_dir: Path, rank: int, **fields: object) -> Path:
    path = run_dir / "logs" / f"rank-{rank}.error.json"
    path.write_text(json.dumps({"rank": rank, "error": "RuntimeError('x')", **fields}))
    return path


def test_one_listing_names_the_ranks_with_a_record_and_nothing_else(tmp_path: Path) -> None:
    (tmp_path / "logs").mkdir()
    for rank in (7, 0, 12):
        _record(tmp_path, rank)
    for other in ("rank-3.log", "stacks-rank-4.txt", "rank-5.consequence.json", "rank-x.error.json",
                  ".stale-9-1.error.json", "rank-99999999999999.error.json"):
        (tmp_path / "logs" / other).write_text("")
    assert ranks_with_records(tmp_path) == [0, 7, 12]
    assert ranks_with_records(tmp_path / "missing") == []


def test_a_record_is_of_the_attempt_its_stamp_names() -> None:
    assert record_is_of(json.dumps({"job_id": "77", "restart": 1}), "77", 1)
    assert not record_is_of(json.dumps({"job_id": "77", "restart": 0}), "77", 1)
    assert not record_is_of(json.dumps({"restart": 1}), "77", 1)  # written before records were stamped
    assert not record_is_of("[" * 100_000, "77", 1)
    assert not record_is_of("not json", "77", 1)


def test_stale_records_go_and_this_attempt_s_stay(tmp_path: Path) -> None:
    (tmp_path / "logs").mkdir()
    _record(tmp_path, 0, job_id="77", restart=0)
    _record(tmp_path, 1)
    fresh = _record(tmp_path, 2, job_id="77", restart=1)  # a rank of this attempt failed already
    assert clear_stale_records(tmp_path, [0, 1, 2, 3], "77", 1) == 2
    assert sorted(os.listdir(tmp_path / "logs")) == ["rank-2.error.json"]
    assert json.loads(fresh.read_text())["restart"] == 1


def test_a_record_written_while_it_is_cleared_is_never_the_one_removed(tmp_path: Path, monkeypatch) -> None:
    """The rank writes its fresh record between rank 0's move aside and rank 0's read: rank 0 reads the stale
    one aside and removes only that; the fresh one, under the usual name, stays."""
    (tmp_path / "logs").mkdir()
    _record(tmp_path, 4, job_id="77", restart=0)
    real_read = error_records.read_record_text

    def read_then_rank_writes(path: Path) -> str:
        text = real_read(path)
        _record(tmp_path, 4, job_id="77", restart=1)
        return text

    monkeypatch.setattr(error_records, "read_record_text", read_then_rank_writes)
    assert clear_stale_records(tmp_path, [4], "77", 1) == 1
    assert json.loads((tmp_path / "logs" / "rank-4.error.json").read_text())["restart"] == 1
    assert sorted(os.listdir(tmp_path / "logs")) == ["rank-4.error.json"]
