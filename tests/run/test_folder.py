"""The run folder: made private, results of an earlier submission cleared, a changed config kept beside."""

from __future__ import annotations

import json
import shutil
import stat
from pathlib import Path

import pytest

from hpc_train.errors import ConfigError
from hpc_train.run.folder import prepare_run_folder
from hpc_train.run.paths import CONFIG_FILE, FLIGHT_RECORDER_DIR, PLAN_FILE, rank_error_path


def _plan(config_hash: str) -> str:
    return json.dumps({"config_hash": config_hash}) + "\n"


def test_a_new_folder_is_private_and_holds_plan_and_config(tmp_path: Path) -> None:
    run_dir = prepare_run_folder(tmp_path / "runs" / "a", _plan("abc"), "[job]\n", "abc")
    assert stat.S_IMODE(run_dir.stat().st_mode) == 0o700 and (run_dir / FLIGHT_RECORDER_DIR).is_dir()
    assert (run_dir / PLAN_FILE).read_text() == _plan("abc") and (run_dir / CONFIG_FILE).read_text() == "[job]\n"


def test_reuse_clears_old_results_and_keeps_a_changed_config(tmp_path: Path) -> None:
    run_dir = prepare_run_folder(tmp_path / "a", _plan("0123456789abcdef"), "old\n", "0123456789abcdef")
    rank_error_path(run_dir, 1).write_text("{}")
    (run_dir / "train.json").write_text("{}")
    prepare_run_folder(run_dir, _plan("fedcba"), "new\n", "fedcba")
    assert not rank_error_path(run_dir, 1).exists() and not (run_dir / "train.json").exists()
    assert (run_dir / "config.0123456789ab.toml").read_text() == "old\n"
    assert (run_dir / CONFIG_FILE).read_text() == "new\n"


def test_a_folder_others_can_write_is_refused(tmp_path: Path) -> None:
    run_dir = tmp_path / "shared"
    run_dir.mkdir()
    run_dir.chmod(0o777)
    with pytest.raises(ConfigError, match="writable by others"):
        prepare_run_folder(run_dir, _plan("x"), "", "x")


@pytest.mark.parametrize("entry", ["", "logs", "checkpoints", "plan.json", "config.toml"])
def test_a_planted_link_is_refused_and_nothing_is_written_through_it(tmp_path: Path, entry: str) -> None:
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "precious.txt").write_text("keep")
    run_dir = tmp_path / "runs" / "a"
    if entry:
        prepare_run_folder(run_dir, _plan("x"), "", "x")
        target = run_dir / entry
        if target.is_dir():
            shutil.rmtree(target)
        target.unlink(missing_ok=True)
        target.symlink_to(victim / "precious.txt" if "." in entry else victim)
    else:
        run_dir.parent.mkdir(parents=True)
        run_dir.symlink_to(victim)
    with pytest.raises(ConfigError, match="symbolic link"):
        prepare_run_folder(run_dir, _plan("y"), "", "y")
    assert sorted(p.name for p in victim.iterdir()) == ["precious.txt"]
    assert (victim / "precious.txt").read_text() == "keep"


def test_a_run_root_everyone_can_write_needs_the_sticky_bit(tmp_path: Path) -> None:
    root = tmp_path / "shared"
    root.mkdir()
    root.chmod(0o777)
    with pytest.raises(ConfigError, match="sticky bit"):
        prepare_run_folder(root / "a", _plan("x"), "", "x")
    assert not (root / "a").exists()
    root.chmod(0o1777)
    run_dir = prepare_run_folder(root / "a", _plan("x"), "", "x")
    assert stat.S_IMODE(run_dir.stat().st_mode) == 0o700
