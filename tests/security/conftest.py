"""The per-case world of the hostile-input corpus: a private tmp tree with stub Slurm tools first on PATH."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.security.harness import World, make_world


@pytest.fixture
def world(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> World:
    made = make_world(tmp_path)
    monkeypatch.setenv("PATH", f"{made.stubs}{os.pathsep}{os.environ.get('PATH', '/usr/bin:/bin')}")
    monkeypatch.setenv("HOME", str(made.home))
    monkeypatch.setenv("COLUMNS", "250")  # rich: one value per line, so literal text is not folded
    for name in ("HPC_TRAIN_SITE_PATH", "SLURM_JOB_ID", "SLURM_CONF", "BASH_ENV", "ENV"):
        monkeypatch.delenv(name, raising=False)
    return made
