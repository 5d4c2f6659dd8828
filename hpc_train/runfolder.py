"""The run folder: created private, written atomically, stable across requeues (keyed by run name)."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

from hpc_train.config.environment import FLIGHT_RECORDER_DIR
from hpc_train.config.plan import Plan
from hpc_train.config.tomlwrite import dumps
from hpc_train.errors import ConfigError

__all__ = ["CONFIG_FILE", "PLAN_FILE", "atomic_write", "prepare_run_folder", "read_json_object"]

PLAN_FILE = "plan.json"
CONFIG_FILE = "config.toml"


def atomic_write(path: Path, text: str, mode: int = 0o600) -> None:
    """Write to a temporary name, fsync, rename over ``path`` and fsync the folder: never a half file."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    descriptor = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, mode)
    with open(descriptor, "w", encoding="utf-8") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.chmod(tmp, mode)
    os.replace(tmp, path)
    folder = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(folder)
    finally:
        os.close(folder)


def read_json_object(path: Path) -> dict[str, Any]:
    """A JSON object from the run folder, or {} when it is missing, torn or not an object: readers on the login
    node show what is there and never fail on a file a rank is rewriting."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def refuse_shared_writable(path: Path) -> None:
    mode = path.stat().st_mode
    if mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise ConfigError(str(path), f"is writable by others (mode {stat.filemode(mode)}); a run folder holds "
                          "code that ranks execute", f"chmod go-w {path}, or pick another job.run_root")
    if path.stat().st_uid != os.getuid():
        raise ConfigError(str(path), "belongs to another user", "pick another job.name or job.run_root")


def _previous_hash(plan_path: Path) -> str | None:
    """The config hash of the plan already in the folder; None when it is missing or unreadable."""
    try:
        value = json.loads(plan_path.read_text(encoding="utf-8")).get("config_hash")
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, str) else None


def prepare_run_folder(plan: Plan) -> Path:
    """Create ``run_dir`` (0700) with ``logs/``, and write ``plan.json`` and ``config.toml`` atomically.

    An existing folder is reused (that is how a run resumes), but only when it is ours and not writable by
    others. A changed config keeps the previous one beside it as ``config.<hash>.toml``.
    """
    run_dir = Path(plan.run_dir)
    old_umask = os.umask(0o077)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        refuse_shared_writable(run_dir)
        (run_dir / "logs").mkdir(exist_ok=True)
        (run_dir / FLIGHT_RECORDER_DIR).mkdir(exist_ok=True)  # torch writes its dumps here, never creates it
    except OSError as error:
        raise ConfigError(str(run_dir), f"cannot create the run folder ({error.strerror or error})",
                          "pick a job.run_root you can write to") from None
    finally:
        os.umask(old_umask)
    for stale in [*(run_dir / "logs").glob("rank-*.error.json"), run_dir / "smoke.json", run_dir / "train.json"]:
        stale.unlink(missing_ok=True)  # results of an earlier submission must not pass for this one's
    plan_path, config_path = run_dir / PLAN_FILE, run_dir / CONFIG_FILE
    if config_path.exists():
        previous = _previous_hash(plan_path)
        if previous != plan.config_hash:
            os.replace(config_path, run_dir / f"config.{(previous or 'unknown')[:12]}.toml")
    atomic_write(run_dir / CONFIG_FILE, dumps(plan.config))
    atomic_write(plan_path, plan.to_json())
    return run_dir
