"""Planted links and loose permissions in a shared run root: refused before anything is written through them.

Why: run folders live on a shared file system, so ``run_root/NAME`` may already exist when a job is rendered or
submitted. A link there (the folder itself, logs/, checkpoints/, submitit/, plan.json, config.toml) would make the
command write, or later ranks load, through someone else's path; a run root anyone may write to without the
sticky bit lets anyone swap the run folder. Each case runs render (to a file) and the real submit (stub sbatch).
"""

from __future__ import annotations

import os
import stat

import pytest

from tests.security.harness import Case, World, cases_ids, on, run_case


def _run_dir(world: World) -> None:
    world.run_dir.mkdir(mode=0o700)


def _link_run_dir(world: World) -> None:
    os.symlink(world.victim, world.run_dir)


def _link_inside(name: str, target: str):
    def setup(world: World) -> None:
        _run_dir(world)
        os.symlink(world.victim_file if target == "file" else world.victim, world.run_dir / name)
    return setup


def _dangling_link(world: World) -> None:
    """A link to a path that does not exist yet: writing through it would create a file in the victim folder."""
    _run_dir(world)
    os.symlink(world.victim / "created-through-link", world.run_dir / "plan.json")


def _chmod_runs(mode: int):
    def setup(world: World) -> None:
        world.runs.chmod(mode)
    return setup


def _existing(mode: int):
    def setup(world: World) -> None:
        _run_dir(world)
        world.run_dir.chmod(mode)
        (world.run_dir / "notes.txt").write_text("kept across submissions\n", encoding="utf-8")
    return setup


def _run_dir_is_file(world: World) -> None:
    world.run_dir.write_text("not a folder\n", encoding="utf-8")


def _foreign_owner(world: World) -> None:
    _run_dir(world)
    os.chown(world.run_dir, 4242, 4242)


def _private_run_dir(world: World, _outcome: object) -> None:
    info = world.run_dir.lstat()
    assert stat.S_ISDIR(info.st_mode), "the run folder is not a real folder"
    assert stat.S_IMODE(info.st_mode) == 0o700, f"the run folder is mode {oct(stat.S_IMODE(info.st_mode))}, not 0700"


def _reused(world: World, outcome: object) -> None:
    _private_run_dir(world, outcome)
    assert (world.run_dir / "notes.txt").read_text(encoding="utf-8") == "kept across submissions\n"
    assert (world.run_dir / "plan.json").is_file(), "no plan.json in the reused run folder"


PLANTED = [
    ("run-dir-link", _link_run_dir, 2, None),
    ("logs-link", _link_inside("logs", "folder"), 2, None),
    ("checkpoints-link", _link_inside("checkpoints", "folder"), 2, None),
    ("submitit-link", _link_inside("submitit", "folder"), 2, None),
    ("plan-json-link", _link_inside("plan.json", "file"), 2, None),
    ("config-toml-link", _link_inside("config.toml", "file"), 2, None),
    ("dangling-plan-link", _dangling_link, 2, None),
    ("run-root-0777", _chmod_runs(0o777), 2, None),
    ("run-root-1777-sticky", _chmod_runs(0o1777), 0, _private_run_dir),
    ("existing-0700", _existing(0o700), 0, _reused),
    ("existing-0777", _existing(0o777), 2, None),
    ("existing-0770", _existing(0o770), 2, None),
    ("run-dir-is-file", _run_dir_is_file, 2, None),
    ("run-dir-foreign-owner", _foreign_owner, 2, None),
]


CASES: list[Case] = []
for label, setup, code, check in PLANTED:
    CASES.append(on("render", f"{label}-render", "", expect=code, setup=setup, check=check))
    CASES.append(on("submit", f"{label}-submit", "", expect=code, setup=setup, check=check))
CASES.append(on("render", "fresh-run-dir-is-private", "", expect=0, check=_private_run_dir))


@pytest.mark.parametrize("case", CASES, ids=cases_ids(CASES))
def test_planted_run_root(case: Case, world: World) -> None:
    run_case(case, world)
