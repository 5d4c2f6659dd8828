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


def test_nothing_is_written_before_every_file_of_the_save_is_staged(tmp_path: Path) -> None:
    """The writer thread waits for announce(): pickling and hashing the first file while the training thread
    copies the next would share the rank's core with that copy."""
    files = RankFiles(rank=0, async_save=True)
    files.begin(tmp_path, staged=True)
    files.save({"w": torch.ones(8)}, tmp_path / "a.pt")
    files.save_built(lambda: {"built": torch.zeros(2)}, tmp_path / "b.pt")
    assert files._jobs.unfinished_tasks == 0 and not (tmp_path / "a.pt").exists()
    files.announce()
    files.drain()
    assert [entry.path for entry in files.entries] == ["a.pt", "b.pt"]
    assert torch.equal(torch.load(tmp_path / "b.pt")["built"], torch.zeros(2))


def test_stable_tensors_are_copied_after_the_call_and_before_settle_returns(tmp_path: Path) -> None:
    """What the caller says stays as it is until its next optimizer step (``stable``) is copied by the writer
    thread: a change before announce() shows in the file, which proves the copy was not made in the call; any
    other tensor is copied in the call; a change after settle() shows nowhere."""
    import threading

    params, buffer = torch.zeros(1000), torch.zeros(10)
    files = RankFiles(rank=0, async_save=True)
    files.begin(tmp_path, staged=True, stable=frozenset({checkpoint_files.storage_of(params)}))
    files.save({"params": params[:500], "buffer": buffer}, tmp_path / "a.pt")  # a view: the storage decides
    params.fill_(1)  # before the writer got the copy: not what a caller may do, but it shows when the copy is made
    buffer.fill_(1)  # copied in the call: the file keeps the zeros
    release = threading.Event()
    files._start()
    files._jobs.put((True, release.wait))  # hold the writer, so that settle() must wait for the copy
    files.announce()
    waiter = threading.Thread(target=files.settle)
    waiter.start()
    waiter.join(0.3)
    assert waiter.is_alive()  # the step would wait here
    release.set()
    waiter.join(30)
    assert not waiter.is_alive() and files.settle_wait_s > 0
    params.fill_(2)  # the optimizer's step, after settle(): not in the file
    files.drain()
    loaded = torch.load(tmp_path / "a.pt")
    assert torch.equal(loaded["params"], torch.ones(500)) and torch.equal(loaded["buffer"], torch.zeros(10))
    files.settle()  # nothing left to wait for: returns at once


def test_close_lets_a_step_waiting_for_dropped_copies_go_on(tmp_path: Path) -> None:
    """A failed life's queued copies are dropped by close(); nothing may wait for them for ever."""
    import threading
    import time

    params = torch.zeros(100)
    files = RankFiles(rank=0, async_save=True)
    files.begin(tmp_path, staged=True, stable=frozenset({checkpoint_files.storage_of(params)}))
    files.save({"params": params}, tmp_path / "a.pt")
    busy, release = threading.Event(), threading.Event()
    files._start()
    files._jobs.put((True, lambda: (busy.set(), release.wait(60))))  # a write under way when close() comes
    assert busy.wait(30)
    files.announce()  # behind it: the copies, the write, the marker
    copied = files._copied
    closing = threading.Thread(target=files.close)
    closing.start()
    deadline = time.monotonic() + 30
    while files._jobs.qsize() > 1 and time.monotonic() < deadline:  # close() dropped all but its own end
        time.sleep(0.01)
    release.set()
    closing.join(30)
    assert not closing.is_alive() and copied is not None and copied.is_set()
    assert not (tmp_path / "a.pt").exists()  # the dropped copy was never written
    files.settle()


def test_a_save_without_announce_leaves_nothing_for_the_next_one(tmp_path: Path) -> None:
    """A save that failed part way (no announce) is dropped by the next begin(): its staged files are never
    written into the next save's folder, and the next step waits for no copy of it."""
    params = torch.zeros(100)
    files = RankFiles(rank=0, async_save=True)
    files.begin(tmp_path / "one", staged=True, stable=frozenset({checkpoint_files.storage_of(params)}))
    files.save({"params": params}, tmp_path / "one" / "a.pt")
    files.begin(tmp_path / "two", staged=True)
    files.settle()
    files.save({"other": torch.ones(3)}, tmp_path / "two" / "b.pt")
    files.announce()
    files.drain()
    assert [entry.path for entry in files.entries] == ["b.pt"] and not (tmp_path / "one").exists()
