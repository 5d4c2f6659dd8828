"""The previous attempt's error records: moved aside by each rank as it starts, listed once and removed by rank 0
after its look-back, and read as the attempt they are stamped with."""

from __future__ import annotations

import json
import os
from pathlib import Path

from hpc_train.run.error_records import clear_kept, keep_aside, kept_path, ranks_with_records, record_is_of


def _record(run_dir: Path, rank: int, **fields: object) -> Path:
    path = run_dir / "logs" / f"rank-{rank}.error.json"
    path.write_text(json.dumps({"rank": rank, "error": "RuntimeError('x')", **fields}))
    return path


def test_a_rank_moves_its_last_record_aside_where_no_reader_of_this_attempt_looks(tmp_path: Path) -> None:
    (tmp_path / "logs").mkdir()
    _record(tmp_path, 3, job_id="77", restart=0)
    keep_aside(tmp_path, 3)
    keep_aside(tmp_path, 4)  # none: nothing happens
    assert os.listdir(tmp_path / "logs") == ["prev-rank-3.error.json"]
    assert json.loads(kept_path(tmp_path, 3).read_text())["restart"] == 0


def test_one_listing_names_the_ranks_with_a_record_kept_or_not_yet(tmp_path: Path) -> None:
    (tmp_path / "logs").mkdir()
    for rank in (7, 0):
        _record(tmp_path, rank)
    keep_aside(tmp_path, 0)
    _record(tmp_path, 12)
    for other in ("ranks-2-3.log", "rank-3.log", "stacks-rank-4.txt", "rank-5.consequence.json", "rank-x.error.json",
                  "prev-rank-y.error.json", "rank-99999999999999.error.json"):
        (tmp_path / "logs" / other).write_text("")
    assert ranks_with_records(tmp_path) == [0, 7, 12]
    assert ranks_with_records(tmp_path / "missing") == []


def test_a_record_is_of_the_attempt_its_stamp_names() -> None:
    assert record_is_of(json.dumps({"job_id": "77", "restart": 1}), "77", 1)
    assert record_is_of({"job_id": "77", "restart": 1}, "77", None)
    assert not record_is_of(json.dumps({"job_id": "77", "restart": 0}), "77", 1)
    assert not record_is_of(json.dumps({"restart": 1}), "77", 1)  # written before records were stamped
    assert not record_is_of("[" * 100_000, "77", 1)
    assert not record_is_of("not json", "77", 1)


def test_rank_0_removes_the_kept_records_and_nothing_of_this_attempt(tmp_path: Path) -> None:
    (tmp_path / "logs").mkdir()
    for rank in (0, 1):
        _record(tmp_path, rank, job_id="77", restart=0)
        keep_aside(tmp_path, rank)
    fresh = _record(tmp_path, 2, job_id="77", restart=1)  # a rank of this attempt failed already
    (tmp_path / "logs" / "ranks-2-3.log").write_text("")  # its node's log
    assert clear_kept(tmp_path) == 2
    assert sorted(os.listdir(tmp_path / "logs")) == ["rank-2.error.json", "ranks-2-3.log"]
    assert json.loads(fresh.read_text())["restart"] == 1
