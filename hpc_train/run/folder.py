"""Creating the run folder: private, reused across requeues (keyed by run name), its plan written atomically.

It takes plain text (the plan's JSON, the config's TOML) rather than the plan itself, so the run folder's
protocol stays below the config package: the config reads the run folder (earlier attempts, excluded nodes),
never the other way round.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from hpc_train.errors import ConfigError
from hpc_train.run.files import atomic_write, refuse_shared_writable
from hpc_train.run.paths import (
    CONFIG_FILE,
    FLIGHT_RECORDER_DIR,
    LOGS_DIR,
    PLAN_FILE,
    RANK_ERROR_GLOB,
    RESULT_FILES,
)

__all__ = ["prepare_run_folder"]


def _previous_hash(plan_path: Path) -> str | None:
    """The config hash of the plan already in the folder; None when it is missing or unreadable."""
    try:
        value = json.loads(plan_path.read_text(encoding="utf-8")).get("config_hash")
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, str) else None


def _make_folders(run_dir: Path) -> None:
    old_umask = os.umask(0o077)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        refuse_shared_writable(run_dir)
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
    stale = [*(run_dir / LOGS_DIR).glob(RANK_ERROR_GLOB), *(run_dir / name for name in RESULT_FILES)]
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
