"""Creating the run folder: private, reused across requeues (keyed by run name), its plan written atomically.

It takes plain text (the plan's JSON, the config's TOML) rather than the plan itself, so the run folder's
protocol stays below the config package: the config reads the run folder (earlier attempts, excluded nodes),
never the other way round.
"""

from __future__ import annotations

import errno
import json
import os
import stat
from pathlib import Path

from hpc_train.errors import ConfigError
from hpc_train.run.files import atomic_write
from hpc_train.run.paths import (
    CHECKPOINTS_DIR,
    CONFIG_FILE,
    FLIGHT_RECORDER_DIR,
    HEARTBEAT_DIR,
    LOGS_DIR,
    PLAN_FILE,
    RANK_ERROR_GLOB,
    RESULT_FILES,
    SUBMITIT_DIR,
    WANDB_DIR,
    WANDB_STATE_FILE,
)

__all__ = ["check_run_folder", "check_run_root", "prepare_run_folder", "private_folder"]


def _previous_hash(plan_path: Path) -> str | None:
    """The config hash of the plan already in the folder; None when it is missing or unreadable."""
    try:
        value = json.loads(plan_path.read_text(encoding="utf-8")).get("config_hash")
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, str) else None


_OPEN_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
# What a run folder holds that hpc_train writes or that ranks read back; none of it may be a link.
_OWN_ENTRIES = (LOGS_DIR, FLIGHT_RECORDER_DIR, CHECKPOINTS_DIR, SUBMITIT_DIR, HEARTBEAT_DIR, PLAN_FILE, CONFIG_FILE,
                WANDB_DIR, WANDB_STATE_FILE)


def _refuse(path: Path, problem: str, fix: str) -> ConfigError:
    return ConfigError(str(path), problem, fix)


def check_run_root(root: Path) -> None:
    """A run root others can write needs the sticky bit (like /tmp): without it anyone can rename our run
    folder away and put a link in its place between two of our steps."""
    try:
        mode = root.stat().st_mode
    except FileNotFoundError:
        return
    except OSError as error:
        raise _refuse(root, f"cannot be read ({error.strerror})", "pick a job.run_root you can use") from None
    if not stat.S_ISDIR(mode):
        raise _refuse(root, "is not a folder", "point job.run_root at a folder")
    if mode & stat.S_IWOTH and not mode & stat.S_ISVTX:
        raise _refuse(root, f"is writable by everyone without the sticky bit (mode {stat.filemode(mode)}): anyone "
                      "could replace a run folder in it with a link", f"chmod o-w,+t {root}, or pick another "
                      "job.run_root")


def check_run_folder(run_dir: Path) -> None:
    """Refuse a run folder that is a link, belongs to someone else or others can write, and any of its own
    entries (logs, checkpoints, the plan, ...) that is a link: hpc_train would write through it. Checked with
    ``lstat`` and an ``O_NOFOLLOW`` open, so no link is ever followed; a missing folder is fine."""
    try:
        descriptor = os.open(run_dir, _OPEN_DIR)
    except FileNotFoundError:
        return
    except OSError as error:
        if error.errno in (errno.ELOOP, errno.ENOTDIR):
            raise _refuse(run_dir, "is a symbolic link or not a folder; a run folder is never reached through a "
                          "link", "remove it (it is not yours to follow), or give the run another job.name") from None
        raise _refuse(run_dir, f"cannot be opened ({error.strerror})", "pick a job.run_root you can use") from None
    try:
        _check_owned(run_dir, os.fstat(descriptor))
        for name in _OWN_ENTRIES:
            try:
                info = os.lstat(name, dir_fd=descriptor) if "/" not in name else os.lstat(run_dir / name)
            except FileNotFoundError:
                continue
            if stat.S_ISLNK(info.st_mode):
                raise _refuse(run_dir / name, "is a symbolic link; hpc_train never writes through one",
                              f"remove the link (rm {run_dir / name})")
            if stat.S_ISDIR(info.st_mode):
                _check_owned(run_dir / name, info)
    finally:
        os.close(descriptor)


def _check_owned(path: Path, info: os.stat_result) -> None:
    if info.st_uid != os.getuid():
        raise _refuse(path, "belongs to another user", "pick another job.name or job.run_root")
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise _refuse(path, f"is writable by others (mode {stat.filemode(info.st_mode)}); a run folder holds code "
                      "that ranks execute", f"chmod go-w {path}, or pick another job.run_root")


def private_folder(path: Path) -> Path:
    """Create ``path`` (0700) if missing, then refuse it unless it is a real folder of ours that others cannot
    write: for submitit's pickles, which every rank unpickles."""
    old_umask = os.umask(0o077)
    try:
        path.mkdir(mode=0o700, exist_ok=True)
    except FileExistsError:
        pass  # a dangling link: refused below
    except OSError as error:
        raise _refuse(path, f"cannot be created ({error.strerror})", "pick a job.run_root you can write to") from None
    finally:
        os.umask(old_umask)
    info = os.lstat(path)
    if not stat.S_ISDIR(info.st_mode):
        raise _refuse(path, "is a symbolic link or not a folder; hpc_train never writes through one",
                      f"remove it (rm {path})")
    _check_owned(path, info)
    return path


def _make_folders(run_dir: Path) -> None:
    """Check the root and every existing part first, then create what is missing: a refusal writes nothing."""
    check_run_root(run_dir.parent)
    check_run_folder(run_dir)
    old_umask = os.umask(0o077)
    try:
        run_dir.parent.mkdir(parents=True, exist_ok=True)
        check_run_root(run_dir.parent)
        run_dir.mkdir(mode=0o700, exist_ok=True)
        check_run_folder(run_dir)  # again: made by us now, or still the one checked
        (run_dir / LOGS_DIR).mkdir(exist_ok=True)
        (run_dir / FLIGHT_RECORDER_DIR).mkdir(exist_ok=True)  # torch writes its dumps here, never creates it
    except OSError as error:
        raise ConfigError(str(run_dir), f"cannot create the run folder ({error.strerror or error})",
                          "pick a job.run_root you can write to") from None
    finally:
        os.umask(old_umask)


def prepare_run_folder(run_dir: str | Path, plan_json: str, config_toml: str, config_hash: str) -> Path:
    """Create ``run_dir`` (0700) with ``logs/``, and write ``plan.json`` and ``config.toml`` atomically.

    An existing folder is reused (that is how a run resumes), but only when it is ours and not writable by
    others. A changed config (``config_hash`` differs from the one in the old plan) keeps the previous one
    beside it as ``config.<hash>.toml``.
    """
    run_dir = Path(run_dir)
    _make_folders(run_dir)
    stale = [*(run_dir / LOGS_DIR).glob(RANK_ERROR_GLOB), *(run_dir / LOGS_DIR).glob("*errors-*.jsonl"),
             *(run_dir / name for name in RESULT_FILES)]
    for path in stale:
        path.unlink(missing_ok=True)  # results of an earlier submission must not pass for this one's
    plan_path, config_path = run_dir / PLAN_FILE, run_dir / CONFIG_FILE
    if config_path.exists():
        previous = _previous_hash(plan_path)
        if previous != config_hash:
            os.replace(config_path, run_dir / f"config.{(previous or 'unknown')[:12]}.toml")
    atomic_write(config_path, config_toml)
    atomic_write(plan_path, plan_json)
    return run_dir
