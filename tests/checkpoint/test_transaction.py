"""Rank 0's commit thread finds the ranks' written markers with one listing a look, never a stat per rank."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest

from hpc_train.checkpoint import CheckpointError
from hpc_train.checkpoint import transaction as checkpoints
from hpc_train.checkpoint.rank_files import WRITTEN_DIR, written_marker
from hpc_train.checkpoint.transaction import CheckpointTransaction


def _mark(tmp: Path, rank: int, **record: object) -> None:
    marker = written_marker(tmp, rank)
    marker.parent.mkdir(exist_ok=True)
    marker.write_text(json.dumps({"rank": rank, **record}))


def _files(rank: int) -> list[dict[str, object]]:
    return [{"path": f"state/rank-{rank}.pt", "size": 10 + rank, "sha256": "0" * 64}]


def _entries(tmp: Path, world: int, timeout_s: float = 30.0) -> list:
    owner = SimpleNamespace(world=world, write_timeout_s=timeout_s, _written=None, _abandoned=threading.Event())
    return CheckpointTransaction._written_entries(owner, tmp)  # type: ignore[arg-type]


def test_markers_that_appear_while_rank_0_waits_are_listed_not_stat_ed(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 0 lists ``.written/`` once a look and reads each marker once, in rank order; a marker still being
    written (its temporary name) and a stray name are not taken for one."""
    world = 64
    (tmp_path / WRITTEN_DIR).mkdir()
    (tmp_path / WRITTEN_DIR / ".rank-5.json.tmp-123").write_text("{")
    (tmp_path / WRITTEN_DIR / f"rank-{'9' * 200}.json").write_text("{}")
    listings: list[int] = []
    real_listdir, looks = os.listdir, iter(range(10_000))

    def listdir(path: object) -> list[str]:
        if next(looks) < 3:  # the ranks write their markers while rank 0 looks
            for rank in range(world):
                if not written_marker(tmp_path, rank).exists() and rank % 3 == len(listings) % 3:
                    _mark(tmp_path, rank, files=_files(rank))
        listings.append(1)
        return real_listdir(path)

    monkeypatch.setattr(checkpoints.os, "listdir", listdir)
    monkeypatch.setattr(checkpoints.os.path, "lexists", lambda _: pytest.fail("a stat per rank"))
    monkeypatch.setattr(checkpoints.time, "sleep", lambda _: None)
    entries = _entries(tmp_path, world)
    assert [entry.path for entry in entries] == [f"state/rank-{rank}.pt" for rank in range(world)]
    assert len(listings) == 3 and not (tmp_path / WRITTEN_DIR).exists()


def test_a_rank_s_error_and_a_rank_that_never_writes_are_reported(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    _mark(tmp_path, 0, files=_files(0))
    _mark(tmp_path, 1, error="rank 1: OSError: disk full")
    with pytest.raises(CheckpointError, match="disk full"):
        _entries(tmp_path, 2)
    monkeypatch.setattr(checkpoints.time, "sleep", lambda _: None)
    (tmp_path / "late").mkdir()
    _mark(tmp_path / "late", 0, files=_files(0))
    with pytest.raises(CheckpointError, match=r"ranks \[1\] did not finish writing late within 0 s"):
        _entries(tmp_path / "late", 2, timeout_s=0.0)


def test_a_failed_life_s_commit_thread_stops_waiting_and_seals_nothing(tmp_path: Path) -> None:
    """After ``close()`` (the life failed, and a warm rank 0 keeps its pid and so its folder names), rank 0's
    commit thread gives up at its next look instead of sealing the old life's checkpoint beside the next one's."""
    (tmp_path / WRITTEN_DIR).mkdir()
    owner = SimpleNamespace(world=2, write_timeout_s=30.0, _written=None, _abandoned=threading.Event())
    _mark(tmp_path, 0, files=_files(0))
    owner._abandoned.set()
    with pytest.raises(CheckpointError, match="abandoned: the life that saved it failed"):
        CheckpointTransaction._written_entries(owner, tmp_path)  # type: ignore[arg-type]
