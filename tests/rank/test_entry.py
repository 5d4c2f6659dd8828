"""A requeued attempt's rank 0 looks back in a thread beside its start-up and carries out the verdict after."""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any

import pytest

from hpc_train.rank import entry as launch
from hpc_train.run.exit_codes import EXIT_NOT_RETRIED, EXIT_STOPPED


def _looking(monkeypatch: pytest.MonkeyPatch, verdict: Any, started: threading.Event | None = None) -> Any:
    def look_back(*_: object) -> int | None:
        if started is not None and not started.wait(timeout=30):  # set by the test once start() has returned
            raise RuntimeError("start() waited for the look-back")
        if isinstance(verdict, BaseException):
            raise verdict
        return verdict

    monkeypatch.setattr(launch, "_look_back", look_back)
    return launch.LookBack.start(Path("/nonexistent"), None, None, logging.getLogger("test"))  # type: ignore[arg-type]


def test_the_rank_goes_on_with_its_start_up_while_the_look_back_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    started = threading.Event()
    looking = _looking(monkeypatch, None, started)
    started.set()  # only reached because start() did not wait
    looking.settle()


@pytest.mark.parametrize("code", [EXIT_STOPPED, EXIT_NOT_RETRIED])
def test_a_requeue_or_a_stop_is_left_with_after_the_imports(monkeypatch: pytest.MonkeyPatch, code: int) -> None:
    with pytest.raises(SystemExit) as left:
        _looking(monkeypatch, code).settle()
    assert left.value.code == code


def test_the_look_back_s_own_failure_reaches_the_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(OSError, match="sacct"):
        _looking(monkeypatch, OSError("sacct is gone")).settle()


def test_no_warm_restart_while_the_failed_life_s_watchdog_still_handles_a_hang() -> None:
    """A watchdog thread still alive after its life ended (its join timed out) may yet end the process: the rank
    then leaves instead of training the next life in it."""
    from hpc_train.rank.runtime.watchdog import THREAD_NAME

    assert not launch._watchdog_busy()
    release = threading.Event()
    deciding = threading.Thread(target=release.wait, name=THREAD_NAME, daemon=True)
    deciding.start()
    try:
        assert launch._watchdog_busy()
    finally:
        release.set()
        deciding.join(5)
    assert not launch._watchdog_busy()
