"""The one reader of run-folder files (issue 39): no link followed at any depth below the run folder, no FIFO
waited on, lines and files bounded with a warning, numbers in range, folders listed never through a link."""

from __future__ import annotations

import errno
import json
import os
import time
from pathlib import Path

import pytest

from hpc_train.errors import ConfigError
from hpc_train.run.files import (
    finite,
    folder_names,
    open_record,
    parse_json,
    read_json_object,
    read_record_text,
    record_lines,
    refuse_link,
    run_file_stat,
    small_int,
    time_value,
)

SECRET = "another place's bytes"  # noqa: S105 - a marker, not a password


def _elsewhere(tmp_path: Path) -> Path:
    other = tmp_path / "elsewhere"
    (other / "nccl-trace").mkdir(parents=True)
    for name in ("latest", "rank-0.log", "x.json", "nccl-trace/dump"):
        (other / name).write_text(SECRET)
    return other


@pytest.mark.parametrize("planted", ["logs", "checkpoints", "heartbeats", "submitit", "logs/nccl-trace"])
def test_a_link_at_any_depth_below_the_run_folder_is_never_followed(tmp_path: Path, planted: str) -> None:
    run, other = tmp_path / "run", _elsewhere(tmp_path)
    run.mkdir()
    if planted != "logs":
        (run / "logs").mkdir()
    (run / planted).symlink_to(other / ("nccl-trace" if planted.endswith("nccl-trace") else ""))
    for name in ("latest", "rank-0.log", "x.json", "dump"):
        path = run / planted / name
        assert read_record_text(path) == "" and read_json_object(path) == {} and run_file_stat(path) is None
        assert list(record_lines(path)) == []
        with pytest.raises(OSError) as refused:
            open_record(path)
        assert refused.value.errno in (errno.ELOOP, errno.ENOTDIR)
    assert folder_names(run / planted) == []


def test_a_linked_file_a_fifo_and_a_folder_are_refused_without_waiting(tmp_path: Path) -> None:
    run, other = tmp_path / "run", _elsewhere(tmp_path)
    (run / "logs").mkdir(parents=True)
    (run / "logs" / "rank-0.log").symlink_to(other / "rank-0.log")
    os.mkfifo(run / "logs" / "rank-1.log")
    (run / "logs" / "rank-2.log").mkdir()
    start = time.monotonic()
    for name in ("rank-0.log", "rank-1.log", "rank-2.log"):
        assert read_record_text(run / "logs" / name) == ""
    assert time.monotonic() - start < 1
    assert sorted(folder_names(run / "logs")) == ["rank-0.log", "rank-1.log", "rank-2.log"]


def test_a_run_folder_given_as_a_link_is_refused_with_exit_2(tmp_path: Path) -> None:
    (tmp_path / "real").mkdir()
    (tmp_path / "alias").symlink_to(tmp_path / "real")
    refuse_link(tmp_path / "real")
    with pytest.raises(ConfigError, match="symbolic link"):
        refuse_link(tmp_path / "alias")


def test_a_30_mb_line_is_skipped_and_said_and_the_records_after_it_are_kept(tmp_path: Path,
                                                                           capsys: pytest.CaptureFixture) -> None:
    path = tmp_path / "metrics.jsonl"
    with open(path, "w") as out:
        out.write('{"step": 1}\n' + "x" * (30 << 20) + '\n{"step": 2}\n{"step": 3}')
    assert [(n, json.loads(line)["step"]) for n, line in record_lines(path)] == [(1, 1), (3, 2), (4, 3)]
    assert f"{path}:2: is longer than 1024 KiB; skipped" in capsys.readouterr().err


def test_numbers_out_of_range_are_damage_and_nan_is_none() -> None:
    assert parse_json('{"loss": NaN, "a": Infinity, "b": -Infinity, "c": 1e400, "d": 1e308, "e": 12}') == {
        "loss": None, "a": None, "b": None, "c": None, "d": 1e308, "e": 12}
    for text in ("1" + "0" * 400, "9" * 5000, "[" * 100_000, '{"a":' * 50_000, "9223372036854775808"):
        with pytest.raises(ValueError):
            parse_json(text)
    assert parse_json("-9223372036854775808") == -(1 << 63)


def test_finite_time_and_small_ints_keep_to_their_ranges() -> None:
    assert finite(10**400) is None and finite(True) is None and finite(float("nan")) is None and finite(2) == 2.0
    assert time_value(1e308) is None and time_value(-1) is None and time_value(1.7e9) == 1.7e9
    assert small_int("9" * 5000) is None and small_int("") is None and small_int("٣") is None
    assert small_int("12") == 12


def test_a_checkpoint_step_folder_that_is_a_link_is_not_read_through(tmp_path: Path) -> None:
    run, other = tmp_path / "run", _elsewhere(tmp_path)
    (run / "checkpoints").mkdir(parents=True)
    (run / "checkpoints" / "step-00000001").symlink_to(other)
    assert read_record_text(run / "checkpoints" / "step-00000001" / "x.json") == ""
    (run / "checkpoints" / "step-00000002").mkdir()
    (run / "checkpoints" / "step-00000002" / "manifest.json").write_text("{}")
    assert read_json_object(run / "checkpoints" / "step-00000002" / "manifest.json") == {}
    assert run_file_stat(run / "checkpoints" / "step-00000002" / "manifest.json") is not None


def test_held_folders_opens_a_subfolder_once_and_closes_it_after(tmp_path: Path) -> None:
    """Inside ``held_folders`` ``logs/`` is opened once for all its files; what is read is that folder even when a
    link replaces it meanwhile (as one listing would see it); every descriptor is closed at the end, and outside
    it a linked ``logs/`` is refused again."""
    from hpc_train.run.files import held_folders, read_record_text

    logs = tmp_path / "run" / "logs"
    logs.mkdir(parents=True)
    for rank in range(50):
        (logs / f"rank-{rank}.error.json").write_text(f'{{"rank": {rank}}}')
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "rank-0.error.json").write_text("SECRET")
    before = len(os.listdir("/proc/self/fd"))
    with held_folders():
        assert [read_record_text(logs / f"rank-{rank}.error.json") for rank in range(50)] == [
            f'{{"rank": {rank}}}' for rank in range(50)]
        assert len(os.listdir("/proc/self/fd")) == before + 1  # logs/ alone, held
        logs.rename(tmp_path / "run" / "logs-old")
        logs.symlink_to(elsewhere)
        assert read_record_text(logs / "rank-0.error.json") == '{"rank": 0}'  # the folder first opened
    assert len(os.listdir("/proc/self/fd")) == before
    assert read_record_text(logs / "rank-0.error.json") == ""  # outside: the link is refused


def test_a_run_root_named_checkpoints_that_is_a_link_still_reads(tmp_path: Path) -> None:
    """``job.run_root = "~/checkpoints"``, a link to scratch (links above the run folder are allowed): the run
    folder's files, its logs and its checkpoints' manifests are read; only links below the run folder are not."""
    from hpc_train.run.files import read_record_text

    scratch = tmp_path / "scratch"
    (scratch / "myrun" / "logs").mkdir(parents=True)
    (scratch / "myrun" / "checkpoints" / "step-00000100").mkdir(parents=True)
    (scratch / "myrun" / "plan.json").write_text("{}")
    (scratch / "myrun" / "logs" / "rank-0.log").write_text("log")
    (scratch / "myrun" / "checkpoints" / "step-00000100" / "manifest.json").write_text("[]")
    (tmp_path / "checkpoints").symlink_to(scratch)
    run = tmp_path / "checkpoints" / "myrun"
    assert read_record_text(run / "plan.json") == "{}"
    assert read_record_text(run / "logs" / "rank-0.log") == "log"
    assert read_record_text(run / "checkpoints" / "step-00000100" / "manifest.json") == "[]"
