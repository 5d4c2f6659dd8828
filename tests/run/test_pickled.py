"""The Python API's pickles in a run folder: a call and a return value round-trip; what does not pickle is
named; a planted link, another user's file or a file others may write is never unpickled."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from hpc_train.errors import ConfigError
from hpc_train.run.paths import FUNCTION_FILE, VALUE_FILE
from hpc_train.run.pickled import Call, read_call, read_value, write_call, write_value


def test_a_call_with_a_closure_and_its_arguments_round_trips(tmp_path: Path) -> None:
    offset = 10

    def shifted(x: int, *, by: int = 0) -> int:
        return x + by + offset

    write_call(tmp_path, Call(shifted, (1,), {"by": 2}))
    call = read_call(tmp_path)
    assert call.function(*call.args, **(call.kwargs or {})) == 13
    assert (tmp_path / FUNCTION_FILE).stat().st_mode & 0o777 == 0o600


def test_arguments_that_do_not_pickle_are_named_and_nothing_is_written(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"cannot pickle .*lock") as error:
        write_call(tmp_path, Call(print, (threading.Lock(),)))
    assert "open such things inside the function" in str(error.value)
    assert not list(tmp_path.iterdir())


def test_a_return_value_that_does_not_pickle_is_kept_as_the_reason(tmp_path: Path) -> None:
    with pytest.raises(OSError):
        read_value(tmp_path)
    kept = write_value(tmp_path, threading.Lock())
    assert kept.problem.startswith("the return value (lock) does not pickle")
    assert read_value(tmp_path).problem == kept.problem
    write_value(tmp_path, {"loss": 0.5})
    assert read_value(tmp_path).value == {"loss": 0.5} and not read_value(tmp_path).problem


def test_a_planted_link_or_a_file_others_may_write_is_never_unpickled(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    write_value(elsewhere, 42)
    run = tmp_path / "run"
    run.mkdir()
    (run / VALUE_FILE).symlink_to(elsewhere / VALUE_FILE)
    with pytest.raises(OSError):
        read_value(run)
    os.chmod(elsewhere / VALUE_FILE, 0o620)  # group-writable
    with pytest.raises(PermissionError, match="not this user's private file"):
        read_value(elsewhere)
