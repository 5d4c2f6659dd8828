"""A build lock left by a killed DeepSpeed op build is removed instead of being waited on forever; a young one
(a build in progress) is waited on."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hpc_train.rank.train.jit_ops import remove_stale_locks
from tests.conftest import REPO


class FakeTime:
    def __init__(self, now: float) -> None:
        self.now = now
        self.slept = 0.0

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds
        self.slept += seconds


def _lock(root: Path, op: str, mtime: float) -> Path:
    (root / op).mkdir(parents=True)
    lock = root / op / "lock"
    lock.touch()
    os.utime(lock, (mtime, mtime))
    return lock


def test_a_lock_older_than_any_build_is_removed_with_a_warning(tmp_path: Path) -> None:
    fake, warnings = FakeTime(10_000.0), []
    lock = _lock(tmp_path, "deepspeed_shm_comm", mtime=10_000.0 - 3600)
    removed = remove_stale_locks(tmp_path, 600, clock=fake.clock, sleep=fake.sleep, warn=warnings.append)
    assert [r.path for r in removed] == [lock] and not lock.exists()
    assert removed[0].age_s == pytest.approx(3600)
    assert len(warnings) == 1 and str(lock) in warnings[0] and "HPC_TRAIN_JIT_LOCK_STALE_S" in warnings[0]


def test_a_young_lock_is_left_alone_without_waiting(tmp_path: Path) -> None:
    fake = FakeTime(10_000.0)
    lock = _lock(tmp_path, "op", mtime=10_000.0 - 5)
    assert remove_stale_locks(tmp_path, 600, wait=False, clock=fake.clock, sleep=fake.sleep) == []
    assert lock.exists() and fake.slept == 0


def test_a_young_lock_is_waited_on_until_it_turns_stale(tmp_path: Path) -> None:
    fake = FakeTime(10_000.0)
    lock = _lock(tmp_path, "op", mtime=10_000.0 - 5)
    removed = remove_stale_locks(tmp_path, 60, clock=fake.clock, sleep=fake.sleep, warn=lambda _: None)
    assert [r.path for r in removed] == [lock] and not lock.exists()
    assert 55 <= fake.slept <= 57  # waited out the rest of the limit, not more


def test_a_lock_released_while_waiting_ends_the_wait(tmp_path: Path) -> None:
    fake = FakeTime(10_000.0)
    lock = _lock(tmp_path, "op", mtime=10_000.0 - 5)

    def sleep_then_release(seconds: float) -> None:
        fake.sleep(seconds)
        if fake.slept >= 3:
            lock.unlink(missing_ok=True)

    assert remove_stale_locks(tmp_path, 600, clock=fake.clock, sleep=sleep_then_release) == []
    assert 3 <= fake.slept < 5


def test_a_missing_root_is_fine(tmp_path: Path) -> None:
    assert remove_stale_locks(tmp_path / "absent") == []


def test_torch_builds_again_past_a_lock_left_by_a_killed_build(tmp_path: Path) -> None:
    """The lock is torch's own ``FileBaton``: while the dead builder's file is there, torch can never acquire it
    (its ``wait`` spins for ever); once it is removed, the next build acquires it."""
    from torch.utils.file_baton import FileBaton

    lock = _lock(tmp_path, "cpu_adam", mtime=time.time() - 3600)
    assert not FileBaton(str(lock)).try_acquire()
    removed = remove_stale_locks(tmp_path, 600, warn=lambda _: None)
    baton = FileBaton(str(lock))
    assert [r.path for r in removed] == [lock] and baton.try_acquire()
    baton.release()


def test_the_command_builds_only_what_an_optimizer_needs() -> None:
    """Nothing to build for torch's AdamW (and no shm all-reduce any more); an unknown name is refused."""
    done = subprocess.run([sys.executable, "-m", "hpc_train.rank.train.jit_ops", "torch_adamw"], cwd=REPO,
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0 and "none needed" in done.stdout, done.stderr[-2000:]
    wrong = subprocess.run([sys.executable, "-m", "hpc_train.rank.train.jit_ops", "adam"], cwd=REPO,
                           capture_output=True, text=True, timeout=120, check=False)
    assert wrong.returncode == 2 and "unknown optimizer 'adam'" in wrong.stderr
