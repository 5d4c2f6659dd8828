"""DCP's shards hashed while written (the entries are the files' real sizes and sha256, the files are private, a
link planted where a shard goes is refused) and checked while read (a flipped byte is reported, a short file
refused)."""

from __future__ import annotations

import hashlib
import os
import stat
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from hpc_train.checkpoint.dcp_files import checking_reader, hashing_writer
from hpc_train.checkpoint.manifest import FileEntry


def _state() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {"weight": torch.randn(64, 32, generator=generator), "bias": torch.randn(32, generator=generator)}


def test_every_shard_is_listed_with_its_real_size_and_sha256_and_loads_back(tmp_path: Path) -> None:
    entries: list[FileEntry] = []
    where = tmp_path / "dcp"
    dcp.save(_state(), storage_writer=hashing_writer(where, tmp_path, entries), checkpoint_id=str(where), no_dist=True)
    shards = sorted(p for p in where.iterdir() if p.suffix == ".distcp")
    assert shards and sorted(e.path for e in entries) == [f"dcp/{p.name}" for p in shards]
    for entry in entries:
        data = (tmp_path / entry.path).read_bytes()
        assert (entry.size, entry.sha256) == (len(data), hashlib.sha256(data).hexdigest())
        assert stat.S_IMODE(os.stat(tmp_path / entry.path).st_mode) == 0o600
    loaded = {name: torch.zeros_like(value) for name, value in _state().items()}
    dcp.load(loaded, checkpoint_id=str(where), no_dist=True)
    assert all(torch.equal(loaded[name], value) for name, value in _state().items())


def test_a_link_planted_where_a_shard_goes_is_refused(tmp_path: Path) -> None:
    where, target = tmp_path / "dcp", tmp_path / "elsewhere"
    where.mkdir()
    target.write_bytes(b"keep")
    (where / "__0_0.distcp").symlink_to(target)
    with pytest.raises(CheckpointException, match="File exists"):  # O_EXCL | O_NOFOLLOW
        dcp.save(_state(), storage_writer=hashing_writer(where, tmp_path, []), checkpoint_id=str(where),
                 no_dist=True)
    assert target.read_bytes() == b"keep"


def _saved(tmp_path: Path) -> tuple[Path, list[FileEntry]]:
    entries: list[FileEntry] = []
    where = tmp_path / "dcp"
    dcp.save(_state(), storage_writer=hashing_writer(where, tmp_path, entries), checkpoint_id=str(where), no_dist=True)
    return where, entries


def _load(where: Path, tmp_path: Path, entries: list[FileEntry], problems: list[str]) -> dict[str, torch.Tensor]:
    loaded = {name: torch.zeros_like(value) for name, value in _state().items()}
    dcp.load(loaded, storage_reader=checking_reader(where, tmp_path, entries, True, problems),
             checkpoint_id=str(where), no_dist=True)
    return loaded


def test_a_good_shard_loads_with_no_problem(tmp_path: Path) -> None:
    where, entries = _saved(tmp_path)
    problems: list[str] = []
    loaded = _load(where, tmp_path, entries, problems)
    assert problems == [] and all(torch.equal(loaded[name], value) for name, value in _state().items())


def test_a_flipped_byte_is_reported_and_the_load_still_reaches_its_end(tmp_path: Path) -> None:
    """Still loaded: every rank must reach the end of DCP's collectives, then they agree to fall back."""
    where, entries = _saved(tmp_path)
    shard = next(where.glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[-9] ^= 0x01
    shard.write_bytes(bytes(data))
    problems: list[str] = []
    _load(where, tmp_path, entries, problems)
    assert problems == [f"dcp/{shard.name} is corrupt: sha256 differs from the manifest"]


def test_a_short_shard_is_refused_naming_it(tmp_path: Path) -> None:
    where, entries = _saved(tmp_path)
    shard = next(where.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:-100])
    with pytest.raises(CheckpointException, match=f"{shard.name} is short"):
        _load(where, tmp_path, entries, [])
