"""A submission sbatch refuses is taken back: new folders go, an existing run folder gets its old bytes back."""

from __future__ import annotations

from pathlib import Path

from hpc_train.login.cli.undo import Undo


def test_new_folders_go_and_an_existing_one_is_restored(tmp_path: Path) -> None:
    kept, new = tmp_path / "kept", tmp_path / "new"
    (kept / "logs").mkdir(parents=True)
    (kept / "plan.json").write_text("old plan")
    (kept / "train.json").write_text("an earlier result")
    (kept / "checkpoints").mkdir()
    (kept / "checkpoints" / "step-00000001").mkdir()
    undo = Undo.record([kept, new])
    new.mkdir()
    (new / "plan.json").write_text("x")
    (kept / "plan.json").write_text("new plan")
    (kept / "train.json").unlink()
    (kept / "submitit").mkdir()
    (kept / "submitit" / "job.pkl").write_bytes(b"pickle")
    (kept / "logs" / "ranks-0-0.log").write_text("x")
    undo.roll_back()
    assert not new.exists()
    assert (kept / "plan.json").read_text() == "old plan" and (kept / "train.json").read_text() == "an earlier result"
    assert not (kept / "submitit").exists() and not (kept / "logs" / "ranks-0-0.log").exists()
    assert (kept / "checkpoints" / "step-00000001").is_dir()


def test_a_link_is_never_followed(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "precious.txt").write_text("keep")
    link = tmp_path / "run"
    link.symlink_to(victim)
    undo = Undo.record([link])
    (victim / "other.txt").write_text("made by someone else")
    undo.roll_back()
    assert sorted(p.name for p in victim.iterdir()) == ["other.txt", "precious.txt"]


def test_a_shared_run_root_is_never_read_or_emptied(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    (shared / "someone-else").mkdir()
    (shared / "their.txt").write_text("theirs")
    (shared / "their.txt").chmod(0)  # not readable by them alone; a snapshot must not try
    fresh = tmp_path / "fresh"
    undo = Undo.record([shared / "mine", fresh / "mine"], roots=[shared, fresh])
    (shared / "mine").mkdir()
    (shared / "another-run").mkdir()  # made meanwhile by another submission
    (fresh / "mine").mkdir(parents=True)
    undo.roll_back()
    assert sorted(p.name for p in shared.iterdir()) == ["another-run", "someone-else", "their.txt"]
    assert not fresh.exists()  # the run root this submission made, empty again
