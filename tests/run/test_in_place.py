"""The restart notice and the agents' barrier in the run folder (hpc_train.run.in_place)."""

from __future__ import annotations

import os
from pathlib import Path

from hpc_train.run.in_place import (
    RestartNotice,
    in_place_index,
    in_place_left,
    mark_ready,
    read_notice,
    ready_count,
    request_restart,
)
from hpc_train.run.paths import restart_notice_path


def _notice(rank: int, why: str) -> RestartNotice:
    return RestartNotice(1, rank, f"n{rank + 1}", "killed", why, 1.0)


def test_the_first_notice_holds_and_later_ones_read_it(tmp_path: Path) -> None:
    first = request_restart(tmp_path, "7.0", _notice(1, "rank 1 ended on SIGKILL"))
    second = request_restart(tmp_path, "7.0", _notice(0, "rank 0 lost its peer"))
    assert first == second == read_notice(tmp_path, "7.0", 1)
    assert second.reason == "rank 1 ended on SIGKILL"
    path = restart_notice_path(tmp_path, "7.0", 1)
    assert oct(path.stat().st_mode & 0o777) == "0o600"
    assert read_notice(tmp_path, "7.0", 2) is None and read_notice(tmp_path, "8.0", 1) is None


def test_an_unreadable_notice_still_restarts_with_an_unknown_cause(tmp_path: Path) -> None:
    path = restart_notice_path(tmp_path, "7.0", 1)
    path.parent.mkdir()
    path.write_text("{not json")
    notice = read_notice(tmp_path, "7.0", 1, settle_s=0.1)
    assert notice is not None and notice.failure_class == "unknown" and notice.in_place == 1


def test_a_planted_link_is_no_notice(tmp_path: Path) -> None:
    path = restart_notice_path(tmp_path, "7.0", 1)
    path.parent.mkdir()
    target = tmp_path / "elsewhere.json"
    target.write_text('{"in_place": 1}')
    os.symlink(target, path)
    assert read_notice(tmp_path, "7.0", 1) is None


def test_ready_markers_count_each_rank_once(tmp_path: Path) -> None:
    for rank in (0, 1, 1):
        mark_ready(tmp_path, "7.0", 1, rank)
    assert ready_count(tmp_path, "7.0", 1, 3) == 2 and ready_count(tmp_path, "7.0", 2, 3) == 0


def test_the_environment_names_the_life_and_what_is_left() -> None:
    assert in_place_index({}) == 0 and in_place_left({}) == 0
    env = {"HPC_TRAIN_IN_PLACE": "1", "HPC_TRAIN_IN_PLACE_LEFT": "1"}
    assert in_place_index(env) == 1 and in_place_left(env) == 1
    assert in_place_index({"HPC_TRAIN_IN_PLACE": "x"}) == 0
