"""Sealing a checkpoint together: each rank hashes and fsyncs a share of the files, rank 0 checks the shares
cover the folder exactly and writes the same manifest it would have written alone."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hpc_train.ckpt import CheckpointError, CheckpointManager
from hpc_train.ckpt.manager import list_files, seal_share

SIZES = {"state/a.pt": 5000, "state/b.pt": 3000, "state/c.pt": 2500, "rng/rank-0.pt": 10, "rng/rank-1.pt": 12}


def _fill(manager: CheckpointManager, step: int) -> Path:
    tmp = manager.begin(step)
    for relative, size in SIZES.items():
        path = tmp / relative
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(bytes([step]) * size)
    return tmp


@pytest.mark.parametrize("ranks", [1, 2, 3, 8])
def test_the_shares_cover_every_file_once(tmp_path: Path, ranks: int) -> None:
    manager = CheckpointManager(tmp_path / "checkpoints", keep=2)
    tmp = _fill(manager, 1)
    files = list_files(tmp)
    shares = [seal_share(tmp, files, rank, ranks) for rank in range(ranks)]
    assert sorted(e.path for share in shares for e in share) == sorted(SIZES)
    if ranks == 2:  # balanced by size: the two biggest files go to different ranks
        assert {e.path for e in shares[0]} & {"state/a.pt"} and {e.path for e in shares[1]} & {"state/b.pt"}


def test_a_commit_of_shares_writes_the_manifest_of_a_plain_commit(tmp_path: Path) -> None:
    together = CheckpointManager(tmp_path / "together", keep=2)
    alone = CheckpointManager(tmp_path / "alone", keep=2)
    tmp = _fill(together, 3)
    files = list_files(tmp)
    sealed = [entry for rank in range(2) for entry in seal_share(tmp, files, rank, 2)]
    fields = {"world_size": 2, "zero_stage": 2, "dtype": "fp32", "config_hash": "x", "created": 1.0,
              "layout": {"tensor": 1, "pipeline": 1, "data": 2, "context": 1}}
    first = together.commit(tmp, fields, sealed=sealed)
    second = alone.commit(_fill(alone, 3), fields)
    assert json.loads((first / "manifest.json").read_text()) == json.loads((second / "manifest.json").read_text())
    assert together.latest_verified() == first


@pytest.mark.parametrize("damage", ["unsealed_file", "missing_entry", "size_changed"])
def test_shares_that_do_not_match_the_folder_are_refused(tmp_path: Path, damage: str) -> None:
    manager = CheckpointManager(tmp_path / "checkpoints", keep=2)
    tmp = _fill(manager, 5)
    files = list_files(tmp)
    sealed = [entry for rank in range(2) for entry in seal_share(tmp, files, rank, 2)]
    if damage == "unsealed_file":
        (tmp / "state" / "late.pt").write_bytes(b"written after the listing")
    elif damage == "missing_entry":
        sealed = sealed[1:]
    else:
        (tmp / "state" / "a.pt").write_bytes(b"short")
    with pytest.raises(CheckpointError, match="do not match the folder"):
        manager.commit(tmp, {"world_size": 2, "zero_stage": 2, "dtype": "fp32", "config_hash": "x",
                             "layout": {"tensor": 1, "pipeline": 1, "data": 2, "context": 1}}, sealed=sealed)
    assert not (tmp_path / "checkpoints" / "latest").exists()
