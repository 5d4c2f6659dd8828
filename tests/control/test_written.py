"""The ranks' written records of an asynchronous save reach rank 0 over the job's coordinator, with no marker
file (issue 38); a rank that cannot tell it writes the file, and rank 0 reads both."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from hpc_train.checkpoint.rank_files import WRITTEN_DIR, RankFiles, written_marker
from hpc_train.checkpoint.transaction import CheckpointTransaction
from hpc_train.control.server import ControlServer
from hpc_train.control.written import WrittenWatch, publish_written

SAVE = "4242-0123456789abcdef"


def _files(rank: int) -> list[dict[str, object]]:
    return [{"path": f"state/rank-{rank}.pt", "size": 10 + rank, "sha256": f"{rank:064x}"}]


def _entries(tmp: Path, world: int, watch: WrittenWatch | None, save_id: str = SAVE,
             timeout_s: float = 30.0) -> list:
    owner = SimpleNamespace(world=world, write_timeout_s=timeout_s, _written=watch, _abandoned=threading.Event())
    owner._rewatch_written = lambda: CheckpointTransaction._rewatch_written(owner)  # type: ignore[arg-type]
    return CheckpointTransaction._written_entries(owner, tmp, save_id)  # type: ignore[arg-type]


def test_records_told_the_coordinator_and_marker_files_are_one_save(tmp_path: Path,
                                                                    coordinator: ControlServer) -> None:
    """Ranks 0-5 tell the coordinator, ranks 6-7 could not and wrote their files; a record of an older save of
    rank 3 is not taken for this one's."""
    watch = WrittenWatch.open()
    assert watch is not None and watch.usable
    tmp = tmp_path / ".tmp-step-00000010-77"
    assert publish_written(3, "4242-older", {"rank": 3, "files": _files(99)})  # the save before
    for rank in range(6):
        assert publish_written(rank, SAVE, {"rank": rank, "files": _files(rank)})
    for rank in (6, 7):
        marker = written_marker(tmp, rank)
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.write_text(json.dumps({"rank": rank, "files": _files(rank)}))
    entries = _entries(tmp, 8, watch)
    assert [(e.path, e.size) for e in entries] == [(f"state/rank-{rank}.pt", 10 + rank) for rank in range(8)]
    assert not (tmp / WRITTEN_DIR).exists()
    watch.close()


def test_a_rank_s_error_told_the_coordinator_fails_the_save(tmp_path: Path, coordinator: ControlServer) -> None:
    watch = WrittenWatch.open()
    tmp = tmp_path / ".tmp-step-00000010-77"
    publish_written(0, SAVE, {"rank": 0, "files": _files(0)})
    publish_written(1, SAVE, {"rank": 1, "error": "rank 1: OSError: disk full"})
    with pytest.raises(Exception, match="disk full"):
        _entries(tmp, 2, watch)


def test_the_writer_thread_tells_the_coordinator_only_when_rank_0_watches(tmp_path: Path,
                                                                          coordinator: ControlServer) -> None:
    watch = WrittenWatch.open()
    assert watch is not None
    online, offline = tmp_path / ".tmp-step-00000001-1", tmp_path / ".tmp-step-00000002-1"
    files = RankFiles(rank=4, async_save=True)
    for folder, save_id in ((online, SAVE), (offline, "")):
        folder.mkdir()
        files.begin(folder, staged=True, save_id=save_id)
        files.announce()
        files.drain()
    deadline = time.monotonic() + 10  # pushed to rank 0's own connection a moment after the rank's set
    while not watch.records(SAVE, set(), 8) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert watch.records(SAVE, set(), 8) == {4: {"rank": 4, "files": []}}
    assert not (online / WRITTEN_DIR).exists()
    assert json.loads(written_marker(offline, 4).read_text()) == {"rank": 4, "files": []}


def test_without_a_coordinator_or_with_a_record_too_long_for_one_message_the_file_is_the_word(
        tmp_path: Path, coordinator: ControlServer, monkeypatch: pytest.MonkeyPatch) -> None:
    many = [{"path": f"state/{index:06d}.pt", "size": index, "sha256": "0" * 64} for index in range(2000)]
    assert not publish_written(0, "x", {"rank": 0, "files": many})
    assert publish_written(0, "x", {"rank": 0, "files": many[:10]})  # the connection is still good after it
    for name in ("HPC_TRAIN_CONTROL", "HPC_TRAIN_CONTROL_TOKEN"):
        monkeypatch.delenv(name)
    assert WrittenWatch.open() is None and not publish_written(0, "x", {"rank": 0, "files": []})


def test_a_step_saved_again_in_the_same_folder_name_waits_for_this_save_s_records(tmp_path: Path,
                                                                                  coordinator: ControlServer,
                                                                                  monkeypatch: pytest.MonkeyPatch
                                                                                  ) -> None:
    """The review's case: the same step saved twice by the same process gets the same folder name, and the
    coordinator still holds every rank's record of the first save; only records of this save's id count."""
    from hpc_train.checkpoint import transaction as checkpoints

    watch = WrittenWatch.open()
    tmp = tmp_path / ".tmp-step-00000100-4242"
    for rank in range(4):
        publish_written(rank, "4242-first-save", {"rank": rank, "files": _files(rank)})
    monkeypatch.setattr(checkpoints.time, "sleep", lambda _: None)
    with pytest.raises(Exception, match=r"ranks \[0, 1, 2, 3\] did not finish writing"):
        _entries(tmp, 4, watch, save_id="4242-second-save", timeout_s=0.0)


def test_a_watch_that_breaks_during_a_save_is_made_again_and_hears_every_record(tmp_path: Path,
                                                                                coordinator: ControlServer) -> None:
    watch = WrittenWatch.open()
    assert watch is not None
    for rank in range(3):
        publish_written(rank, SAVE, {"rank": rank, "files": _files(rank)})
    watch.client.close()  # the connection dropped (a network blip, the server's limit on what it queues)
    assert not watch.usable
    entries = _entries(tmp_path, 3, watch)
    assert [e.path for e in entries] == [f"state/rank-{rank}.pt" for rank in range(3)]
