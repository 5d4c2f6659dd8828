"""Rank 0's stop notice and another rank's stop request, as files: written whole, read back, an older run of the
same attempt name ignored, a torn or foreign file never taken for a notice."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from hpc_train.run.paths import stop_notice_path, stop_request_path
from hpc_train.run.stops import (
    StopNotice,
    attempt_key,
    publish_notice,
    read_notice,
    read_request,
    request_stop,
    wait_for_done,
)


def test_a_notice_is_read_back_whole_and_only_for_its_own_attempt_and_run(tmp_path: Path) -> None:
    now = time.time()
    notice = StopNotice(attempt_key("42", 1), "stopping", now, "SIGUSR2", "scontrol", 0, "scontrol requeue 42", None)
    publish_notice(tmp_path, notice)
    assert oct(stop_notice_path(tmp_path, "42.1").stat().st_mode & 0o777) == "0o600"
    assert read_notice(tmp_path, "42.1", since=now) == notice
    assert read_notice(tmp_path, "42.2") is None
    assert read_notice(tmp_path, "42.1", since=now + 30) is None  # a later run of the same attempt name
    assert attempt_key(None, 3) == "local.3" and attempt_key("", 0) == "local.0"


def test_a_torn_or_foreign_file_is_no_notice(tmp_path: Path) -> None:
    (tmp_path / "heartbeats").mkdir()
    for text in ('{"attempt": "42.1", "phase": "stop', "[]", '{"attempt": "42.1", "phase": "maybe", "time": 1}',
                 '{"attempt": "42.1", "phase": "done", "time": "soon"}'):
        stop_notice_path(tmp_path, "42.1").write_text(text)
        assert read_notice(tmp_path, "42.1") is None


def test_waiting_for_done_returns_once_rank_0_has_published_it(tmp_path: Path) -> None:
    now = time.time()
    stopping = StopNotice("local.0", "stopping", now, "SIGUSR2", "local", 144, "the local executor restarts")
    publish_notice(tmp_path, stopping)
    assert wait_for_done(tmp_path, "local.0", now, timeout_s=0.3) is None
    done = StopNotice("local.0", "done", now + 0.2, "SIGUSR2", "local", 144, "the local executor restarts", 17)
    threading.Timer(0.2, publish_notice, (tmp_path, done)).start()
    assert wait_for_done(tmp_path, "local.0", now, timeout_s=10) == done


def test_a_request_names_the_signal_of_the_rank_that_asked(tmp_path: Path) -> None:
    now = time.time()
    assert read_request(tmp_path, "42.0") is None
    request_stop(tmp_path, "42.0", 3, "SIGUSR2")
    assert read_request(tmp_path, "42.0", since=now) == "SIGUSR2"
    assert read_request(tmp_path, "42.1") is None
    stop_request_path(tmp_path, "42.0").write_text("{")
    assert read_request(tmp_path, "42.0") is None


def test_a_link_planted_in_place_of_a_notice_is_never_followed(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere.json"
    publish_notice(tmp_path, StopNotice("42.1", "done", time.time(), "SIGUSR2", "none", 75, "why"))
    elsewhere.write_bytes(stop_notice_path(tmp_path, "42.1").read_bytes())
    stop_notice_path(tmp_path, "42.1").unlink()
    stop_notice_path(tmp_path, "42.1").symlink_to(elsewhere)
    assert read_notice(tmp_path, "42.1") is None


@pytest.mark.parametrize("when", ["1" + "0" * 400, "[" * 100_000])
def test_a_stop_notice_with_a_number_no_float_holds_is_no_notice(when: str) -> None:
    from hpc_train.run.stops import StopNotice

    with pytest.raises(ValueError):
        StopNotice.from_json('{"attempt": "a", "phase": "done", "time": ' + when + ', "signal": "SIGTERM", '
                             '"action": "x", "exit_code": 75, "reason": "r"}')
