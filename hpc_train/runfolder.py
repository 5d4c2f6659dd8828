"""The run folder: created private, written atomically, stable across requeues (keyed by run name)."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

from hpc_train.config.plan import Plan
from hpc_train.config.tomlwrite import dumps
from hpc_train.errors import ConfigError

__all__ = ["CONFIG_FILE", "PLAN_FILE", "atomic_write", "prepare_run_folder"]

PLAN_FILE = "plan.json"
CONFIG_FILE = "config.toml"


def atomic_write(path: Path, text: str) -> None:
    """Write to a temporary name, fsync, rename over ``path`` and fsync the folder: never a half file."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.chmod(tmp, 0o600)
    os.replace(tmp, path)
    folder = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(folder)
    finally:
        os.close(folder)


def _refuse_shared_writable(path: Path) -> None:
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
        _refuse_shared_writable(run_dir)
        (run_dir / "logs").mkdir(exist_ok=True)
    finally:
        os.umask(old_umask)
    for stale in (run_dir / "logs").glob("rank-*.error.json"):
        stale.unlink()  # failures of an earlier submission must not be reported as this one's
    plan_path, config_path = run_dir / PLAN_FILE, run_dir / CONFIG_FILE
    if config_path.exists():
        previous = _previous_hash(plan_path)
        if previous != plan.config_hash:
            os.replace(config_path, run_dir / f"config.{(previous or 'unknown')[:12]}.toml")
    atomic_write(run_dir / CONFIG_FILE, dumps(plan.config))
    atomic_write(plan_path, plan.to_json())
    return run_dir
