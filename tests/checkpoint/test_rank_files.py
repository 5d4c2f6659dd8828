"""One rank's checkpoint files (hpc_train.checkpoint.rank_files; DeepSpeed's through
hpc_train.checkpoint.deepspeed_files): a staged save writes the state as it was at the save, not what training made
of it afterwards; a file too big for free memory is written at once; a failed background write reaches rank 0
through the marker; a load reads once, checks, and reports a corrupt file without stopping half way."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from hpc_train.checkpoint import rank_files as checkpoint_files
from hpc_train.checkpoint.deepspeed_files import FileCheckpointEngine
from hpc_train.checkpoint.manifest import FileEntry
from hpc_train.checkpoint.rank_files import RankFiles, written_marker


def _state() -> dict[str, object]:
    return {"w": torch.arange(1000, dtype=torch.float32), "numpy": np.arange(4), "step": 3,
            "groups": [{"lr": 0.1, "params": [0, 1]}]}


def test_a_staged_save_writes_the_state_at_the_save(tmp_path: Path) -> None:
    files = RankFiles(rank=1, async_save=True)
    files.begin(tmp_path, staged=True)
    state = _state()
    files.save(state, tmp_path / "state" / "a.pt")
    state["w"].add_(1)  # what the next optimizer step does to the real tensors
    state["numpy"] += 1  # type: ignore[operator]
    state["groups"][0]["lr"] = 0.2  # type: ignore[index]
    files.announce()
    files.drain()
    loaded = torch.load(tmp_path / "state" / "a.pt", weights_only=False)
    assert torch.equal(loaded["w"], torch.arange(1000, dtype=torch.float32))
    assert loaded["numpy"].tolist() == [0, 1, 2, 3] and loaded["groups"][0]["lr"] == 0.1
    marker = json.loads(written_marker(tmp_path, 1).read_text())
    assert [FileEntry(**item) for item in marker["files"]] == files.entries
    assert files.entries[0].path == "state/a.pt"
    assert files.entries[0].size == (tmp_path / "state" / "a.pt").stat().st_size


def test_the_next_save_stages_into_the_same_buffers(tmp_path: Path) -> None:
    files = RankFiles(rank=0, async_save=True)
    for step in (1, 2):
        folder = tmp_path / f"step-{step}"
        files.begin(folder, staged=True)
        files.save({"w": torch.full((64,), float(step))}, folder / "a.pt")
        first = files._buffers["a.pt"][0]
        if step == 1:
            kept = first
        files.announce()
        files.drain()
    assert first is kept  # no allocation for the second save
    assert torch.equal(torch.load(tmp_path / "step-1" / "a.pt")["w"], torch.full((64,), 1.0))
    assert torch.equal(torch.load(tmp_path / "step-2" / "a.pt")["w"], torch.full((64,), 2.0))


def test_a_file_too_big_for_free_memory_is_written_before_training_goes_on(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(checkpoint_files, "available_memory", lambda: 1000)
    files = RankFiles(rank=0, async_save=True)
    files.begin(tmp_path, staged=True)
    files.save(_state(), tmp_path / "big.pt")
    assert (tmp_path / "big.pt").exists() and len(files.entries) == 1  # written in the call, no thread


def test_a_failed_background_write_is_in_the_marker(tmp_path: Path) -> None:
    files = RankFiles(rank=2, async_save=True)
    files.begin(tmp_path, staged=True)
    (tmp_path / "taken.pt").write_bytes(b"x")  # the writer never replaces a file
    files.save(_state(), tmp_path / "taken.pt")
    files.save(_state(), tmp_path / "later.pt")
    files.announce()
    files.drain()
    marker = json.loads(written_marker(tmp_path, 2).read_text())
    assert marker["error"].startswith("rank 2: FileExistsError") and "files" not in marker
    assert not (tmp_path / "later.pt").exists()  # nothing more after a failure


def test_a_load_checks_and_reports_a_corrupt_file_but_still_deserializes_it(tmp_path: Path) -> None:
    files = RankFiles(rank=0, async_save=False)
    files.begin(tmp_path, staged=False)
    engine = FileCheckpointEngine(files)
    engine.save({"w": torch.ones(4096)}, str(tmp_path / "state" / "m.pt"))
    path = tmp_path / "state" / "m.pt"
    data = bytearray(path.read_bytes())
    data[-2000] ^= 0x10  # inside the tensor's bytes: the pickle still reads
    path.write_bytes(bytes(data))
    files.begin_load(tmp_path, files.entries, check_sha256=True)
    loaded = engine.load(str(path), map_location="cpu")
    assert loaded["w"].shape == (4096,)
    assert files.load_problems == ["state/m.pt is corrupt: sha256 differs from the manifest"]
    files.load_problems.clear()
    files.begin_load(tmp_path, files.entries, check_sha256=False)
    engine.load(str(path))
    assert files.load_problems == []  # sizes match: only sha256 can tell


def test_loads_refuse_code_in_a_pickle(tmp_path: Path) -> None:
    path = tmp_path / "evil.pt"
    torch.save({"f": print}, path)  # a global weights_only does not allow
    files = RankFiles(rank=0, async_save=False)
    with pytest.raises(Exception, match=r"[Ww]eights only load failed|Unsupported global"):
        files.load(path)


def test_close_ends_the_writer_after_the_write_under_way_and_drops_what_is_queued() -> None:
    """A failed life's writer (RankFiles.close, before a warm restart): the write under way finishes, the queued
    ones of the failed life are never written, the thread ends and the staging buffers go."""
    import threading
    import time

    files = RankFiles(0, async_save=True)
    started, done, dropped = threading.Event(), [], []

    def under_way() -> None:
        started.set()
        time.sleep(0.3)
        done.append(1)

    files._start()
    files._jobs.put((False, under_way))
    files._jobs.put((False, lambda: dropped.append(1)))
    files._buffers["module.pt"] = [torch.zeros(4)]
    assert started.wait(30)
    thread = files._thread
    files.close()
    assert thread is not None and not thread.is_alive()
    assert done == [1] and dropped == [] and files._buffers == {}
