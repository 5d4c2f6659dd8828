"""A rank hears the stop notice and a peer's stop request from its job's coordinator (no run-folder read in its
once-a-second check), and reads the run folder as before where no agent named a coordinator."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from hpc_train.control.server import ControlServer
from hpc_train.run.paths import stop_notice_path, stop_request_path
from hpc_train.run.stops import StopNotice, publish_notice, read_notice, read_request, request_stop


def _until(check, timeout_s: float = 5.0):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not (value := check()) and time.monotonic() < deadline:
        time.sleep(0.02)
    return value


def test_a_rank_hears_the_stop_notice_from_the_coordinator_not_the_file(tmp_path: Path,
                                                                       coordinator: ControlServer) -> None:
    assert read_notice(tmp_path, "42.0") is None  # opens this process's connection, watching rank/ keys
    notice = StopNotice("42.0", "stopping", time.time(), "SIGUSR2", "scontrol", 0, "preempted", 7)
    publish_notice(tmp_path, notice)
    assert stop_notice_path(tmp_path, "42.0").exists()  # the durable record is written all the same
    stop_notice_path(tmp_path, "42.0").unlink()
    assert _until(lambda: read_notice(tmp_path, "42.0")) == notice  # from memory: the file is gone


def test_rank_0_hears_a_peers_stop_request_from_the_coordinator(tmp_path: Path,
                                                                coordinator: ControlServer) -> None:
    assert read_request(tmp_path, "42.0") is None
    request_stop(tmp_path, "42.0", 3, "SIGTERM")
    stop_request_path(tmp_path, "42.0").unlink()
    assert _until(lambda: read_request(tmp_path, "42.0")) == "SIGTERM"


def test_without_a_coordinator_the_run_folder_is_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HPC_TRAIN_CONTROL", raising=False)
    notice = StopNotice("43.0", "done", time.time(), "SIGUSR2", "none", 0, "done", 3)
    publish_notice(tmp_path, notice)
    request_stop(tmp_path, "43.0", 1, "SIGUSR2")
    assert read_notice(tmp_path, "43.0") == notice and read_request(tmp_path, "43.0") == "SIGUSR2"


def test_every_watchdog_hears_the_first_hang_from_the_coordinator(tmp_path: Path, coordinator: ControlServer) -> None:
    from hpc_train.rank.runtime.watchdog import Hang, Timeouts, Watchdog
    from hpc_train.run.paths import HEARTBEAT_DIR, hang_marker_path

    (tmp_path / HEARTBEAT_DIR).mkdir(mode=0o700)
    long = Timeouts(startup=60, step=60, checkpoint=60)
    first, other = (Watchdog(tmp_path, rank, 2, "9.0", long, None, lambda _: None) for rank in (1, 0))
    assert other._current_marker() is None
    hang = Hang(1, "n2", "step", 12, 61.0, 60.0, time.time())
    assert first._claim_marker(hang) == hang
    assert hang_marker_path(tmp_path, "9.0").exists()  # the record
    hang_marker_path(tmp_path, "9.0").unlink()
    assert _until(other._current_marker) == hang
    later = Hang(0, "n1", "step", 12, 62.0, 60.0, time.time())
    assert other._claim_marker(later) == hang


def test_every_rank_hears_rank_0_s_hang_decision_from_the_coordinator(tmp_path: Path,
                                                                     coordinator: ControlServer) -> None:
    """The decision file is the record; the ranks waiting for it hear it pushed (16,384 of them would otherwise
    read the file five times a second each)."""
    from hpc_train.rank.runtime.watchdog import Decision, Hang, Timeouts, Watchdog
    from hpc_train.run.paths import HEARTBEAT_DIR, hang_decision_path

    (tmp_path / HEARTBEAT_DIR).mkdir(mode=0o700)
    long = Timeouts(startup=60, step=60, checkpoint=60)
    rank0 = Watchdog(tmp_path, 0, 2, "9.1", long, lambda _: (144, "requeued"), lambda _: None)
    rank1 = Watchdog(tmp_path, 1, 2, "9.1", long, None, lambda _: None)
    hang = Hang(1, "n2", "step", 12, 61.0, 60.0, time.time())
    assert rank1._decision_for(hang) is None  # opens the watching connection
    rank0._wait_for_stacks = lambda _hang: None  # type: ignore[method-assign]  # no ranks dump here
    assert rank0._decide(hang) == Decision(144, "requeued")
    assert hang_decision_path(tmp_path, "9.1").exists()  # the record
    hang_decision_path(tmp_path, "9.1").unlink()
    assert _until(lambda: rank1._decision_for(hang, with_file=False)) == Decision(144, "requeued")
    other = Hang(0, "n1", "step", 12, 62.0, 60.0, time.time() + 5)
    assert rank1._decision_for(other) is None  # a decision on another hang is not this one's
    # rank 0's push lost (its own connection broke): the record is read too, every 2 s of the wait
    hang_decision_path(tmp_path, "9.1").write_text(json.dumps({"hang": other.time, "exit_code": 79, "reason": "x",
                                                               "suspects": [1]}))
    assert rank1._decision_for(other, with_file=False) is None
    assert rank1._decision_for(other) == Decision(79, "x", (1,))


def test_a_process_that_lives_on_connects_again_where_its_link_broke(coordinator: ControlServer) -> None:
    """A warm restart's next life: the link its last life lost is forgotten (forget_broken), and the next look
    connects again instead of reading the run folder's files for the rest of the job."""
    from hpc_train.control.events import forget_broken, rank_events

    first = rank_events()
    assert first is not None
    first.client.close()  # the link breaks
    _until(lambda: not first.usable)
    assert rank_events() is None  # the files are the word now
    forget_broken()
    again = rank_events()
    assert again is not None and again is not first and again.usable
    again.client.close()
    forget_broken()
