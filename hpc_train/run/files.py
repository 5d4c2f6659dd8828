"""How run-folder files are written and read: atomically, privately, and without failing on a torn file.

Ranks rewrite files that login-node commands read at any moment, and a run folder holds code that ranks
execute, so every writer goes through :func:`atomic_write` and every folder is checked by
:func:`refuse_shared_writable`.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

from hpc_train.errors import ConfigError

__all__ = ["atomic_write", "read_json_object", "refuse_shared_writable"]


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
    """ConfigError unless ``path`` is ours and not writable by group or others: ranks execute what it holds."""
    mode = path.stat().st_mode
    if mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise ConfigError(str(path), f"is writable by others (mode {stat.filemode(mode)}); a run folder holds "
                          "code that ranks execute", f"chmod go-w {path}, or pick another job.run_root")
    if path.stat().st_uid != os.getuid():
        raise ConfigError(str(path), "belongs to another user", "pick another job.name or job.run_root")
