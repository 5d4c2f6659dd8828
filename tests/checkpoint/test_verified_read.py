"""A checkpoint file read straight into the caller's buffers, hashed in the file's order whatever the order of reads."""

from __future__ import annotations

import io
import os
from pathlib import Path

import pytest

from hpc_train.checkpoint import verified_read
from hpc_train.checkpoint.verified_read import GAP_FILL, VerifiedReader, verified
from hpc_train.checkpoint.writer import VerifyError, write_file


def _file(tmp_path: Path, data: bytes, name: str = "f") -> tuple[Path, object]:
    entry = write_file(tmp_path, name, lambda sink: sink.write(data))
    return tmp_path / name, entry


def test_any_order_of_reads_hashes_the_whole_file_in_its_order(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(verified_read, "BLOCK", 1 << 16)  # several blocks per read
    data = os.urandom(5 * GAP_FILL + 777)
    path, entry = _file(tmp_path, data)
    reads = [(len(data) - 100, 100),  # the end first, as torch.load reads a zip's directory
             (0, 8), (0, 4), (30, 60),  # the start, read twice
             (200, 3 * GAP_FILL),  # past a small gap (hashed from the file first), several blocks
             (4 * GAP_FILL, 1000),  # far ahead: left for finish()
             (3 * GAP_FILL + 500, 10)]  # back, inside what is hashed
    with verified(path, entry, True) as reader:
        for start, size in reads:
            reader.seek(start)
            assert reader.read(size) == data[start:start + size]
        reader.seek(-10, io.SEEK_END)
        assert reader.read() == data[-10:] and reader.read(5) == b""
        assert reader.finish() is True
    assert reader.closed


def test_a_wrong_sha256_is_served_then_reported_and_a_wrong_size_refused(tmp_path: Path) -> None:
    data = bytearray(b"0123456789" * 1000)
    path, entry = _file(tmp_path, bytes(data))
    data[5000] ^= 1
    path.write_bytes(bytes(data))
    with verified(path, entry, False) as reader:
        assert reader.read() == data and reader.finish() is True  # sizes match: only sha256 can tell
    with verified(path, entry, True) as reader:
        assert reader.read(100) == data[:100]  # served: the caller's collective load goes on to its end
        assert reader.finish() is False
    path.write_bytes(bytes(data[:-1]))
    with pytest.raises(VerifyError, match=r"is short \(truncated\): 9999 bytes, manifest says 10000"):
        VerifiedReader(path, entry, False)
    os.symlink(path, tmp_path / "l")
    with pytest.raises(OSError):
        VerifiedReader(tmp_path / "l", None, False)


def test_torch_load_reads_each_record_straight_into_its_tensor(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    state = {f"t{i}": torch.full((1 << 18,), float(i)) for i in range(12)} | {"step": 3}
    entry = write_file(tmp_path, "s.pt", lambda sink: torch.save(state, sink))
    sizes: list[int] = []
    with verified(tmp_path / "s.pt", entry, True) as reader:
        readinto = reader.readinto
        reader.readinto = lambda target: (sizes.append(len(memoryview(target))), readinto(target))[1]  # type: ignore
        loaded = torch.load(reader, weights_only=True)
        assert reader.finish() is True
    assert all(torch.equal(loaded[k], v) for k, v in state.items() if k != "step") and loaded["step"] == 3
    assert sizes.count(1 << 20) == 12  # one read per 1 MiB record, into the tensor's own memory: no whole-file copy


def test_a_file_that_shrinks_while_read_is_said_as_such(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    entry = write_file(tmp_path, "s.pt", lambda sink: torch.save({"t": torch.zeros(1 << 20)}, sink))
    path = tmp_path / "s.pt"
    with pytest.raises(VerifyError, match="shrank while it was read"), verified(path, entry, True) as reader:
        reader.seek(-100, io.SEEK_END)
        reader.read(100)
        os.truncate(path, 1 << 16)  # the record's bytes are gone under the load
        reader.seek(0)
        torch.load(reader, weights_only=True)


def test_a_refused_file_leaves_no_descriptor_and_bad_seeks_are_refused(tmp_path: Path) -> None:
    path, entry = _file(tmp_path, b"x" * 100)
    path.write_bytes(b"x" * 99)
    before = len(os.listdir("/proc/self/fd"))
    for _ in range(20):
        with pytest.raises(VerifyError):
            VerifiedReader(path, entry, True)
    assert len(os.listdir("/proc/self/fd")) == before
    path.write_bytes(b"x" * 100)
    with verified(path, entry, True) as reader:
        with pytest.raises(ValueError, match="cannot seek"):
            reader.seek(-1)
        with pytest.raises(ValueError, match="cannot seek"):
            reader.seek(0, 7)
        reader.seek(150)  # past the end, within the gap that is hashed first: nothing to read, nothing wrong
        assert reader.read(10) == b"" and reader.finish() is True
