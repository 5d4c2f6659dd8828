"""Files hashed while written and checked while read (hpc_train.checkpoint.writer), and a commit of the entries the
writers made: the same manifest a commit that hashes the folder itself writes, nothing read back, and entries
that do not match the folder refused."""

from __future__ import annotations

import hashlib
import json
import os
import stat
from pathlib import Path

import pytest

from hpc_train.checkpoint import CheckpointError, CheckpointManager
from hpc_train.checkpoint.manifest import FileEntry
from hpc_train.checkpoint.writer import HashingFile, ViewReader, write_file

SIZES = {"state/a.pt": 5000, "state/b.pt": 3000, "state/c.pt": 2500, "rng/rank-0.pt": 10, "rng/rank-1.pt": 12}
FIELDS = {"world_size": 2, "zero_stage": 2, "dtype": "fp32", "config_hash": "x", "created": 1.0,
          "layout": {"tensor": 1, "pipeline": 1, "data": 2, "context": 1}}


def _write_all(tmp: Path, step: int) -> list[FileEntry]:
    return [write_file(tmp, relative, lambda sink, n=size: sink.write(bytes([step]) * n))
            for relative, size in SIZES.items()]


def test_an_entry_is_the_size_and_sha256_of_the_bytes_on_disk(tmp_path: Path) -> None:
    blocks = [os.urandom(3 << 20), b"", os.urandom(17 << 20), memoryview(os.urandom(1000))]
    entry = write_file(tmp_path, "sub/file.bin", lambda sink: [sink.write(block) for block in blocks])
    data = (tmp_path / "sub" / "file.bin").read_bytes()
    assert entry == FileEntry("sub/file.bin", len(data), hashlib.sha256(data).hexdigest())
    assert data == b"".join(bytes(block) for block in blocks)
    assert stat.S_IMODE((tmp_path / "sub" / "file.bin").stat().st_mode) == 0o600


def test_torch_save_into_the_writer_loads_back(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    state = {"w": torch.randn(300, 70), "step": 7, "nested": [torch.arange(5)]}
    entry = write_file(tmp_path, "s.pt", lambda sink: torch.save(state, sink))
    loaded = torch.load(tmp_path / "s.pt", weights_only=True)
    assert torch.equal(loaded["w"], state["w"]) and loaded["step"] == 7 and torch.equal(loaded["nested"][0],
                                                                                          torch.arange(5))
    assert entry.size == (tmp_path / "s.pt").stat().st_size
    again = torch.load(ViewReader(memoryview((tmp_path / "s.pt").read_bytes())), weights_only=True)
    assert torch.equal(again["w"], state["w"])


def test_an_existing_file_or_a_planted_link_is_never_written_through(tmp_path: Path) -> None:
    (tmp_path / "target").write_bytes(b"keep")
    os.symlink(tmp_path / "target", tmp_path / "link")
    for name in ("target", "link"):
        with pytest.raises(FileExistsError):
            write_file(tmp_path, name, lambda sink: sink.write(b"x"))
    assert (tmp_path / "target").read_bytes() == b"keep"


def test_the_writer_answers_as_a_writable_binary_file(tmp_path: Path) -> None:
    descriptor = os.open(tmp_path / "x", os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        sink = HashingFile(descriptor)
        assert sink.writable() and sink.write(b"abc") == 3 and sink.tell() == 3
        sink.flush()
    finally:
        os.close(descriptor)


def test_a_commit_of_written_entries_writes_the_manifest_of_a_hashing_commit(tmp_path: Path) -> None:
    together = CheckpointManager(tmp_path / "together", keep=2)
    alone = CheckpointManager(tmp_path / "alone", keep=2)
    tmp = together.begin(3)
    sealed = _write_all(tmp, 3)
    (tmp / "latest").write_text("state")  # a file a library wrote by itself: the commit hashes it
    first = together.commit(tmp, FIELDS, sealed=sealed)
    other = alone.begin(3)
    _write_all(other, 3)
    (other / "latest").write_text("state")
    second = alone.commit(other, FIELDS)
    assert json.loads((first / "manifest.json").read_text()) == json.loads((second / "manifest.json").read_text())
    assert together.latest_verified() == first


@pytest.mark.parametrize("damage", ["gone", "size_changed", "listed_twice"])
def test_entries_that_do_not_match_the_folder_are_refused(tmp_path: Path, damage: str) -> None:
    manager = CheckpointManager(tmp_path / "checkpoints", keep=2)
    tmp = manager.begin(5)
    sealed = _write_all(tmp, 5)
    if damage == "gone":
        (tmp / "state" / "a.pt").unlink()
    elif damage == "size_changed":
        (tmp / "state" / "a.pt").write_bytes(b"short")
    else:
        sealed.append(sealed[0])
    with pytest.raises(CheckpointError, match="do not match the folder"):
        manager.commit(tmp, FIELDS, sealed=sealed)
    assert not (tmp_path / "checkpoints" / "latest").exists()


def test_pruning_in_the_background_keeps_the_newest(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path / "checkpoints", keep=2, background_prune=True)
    for step in (1, 2, 3, 4):
        tmp = manager.begin(step)
        manager.commit(tmp, FIELDS, sealed=_write_all(tmp, step))
    manager.wait()
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["latest", "step-00000003",
                                                                            "step-00000004"]
