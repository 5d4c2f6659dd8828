"""The per-case world of the hostile-input corpus: a private tmp tree, with stub Slurm tools first on PATH."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

from tests.security.harness import World, make_stubs, make_world


@pytest.fixture(scope="session")
def stub_tools(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """srun, sbatch, squeue, ... that run nothing (written once; no case's snapshot sees them)."""
    folder = tmp_path_factory.mktemp("security-stubs")
    make_stubs(folder)
    return folder


@pytest.fixture
def world(tmp_path: Path, stub_tools: Path, monkeypatch: pytest.MonkeyPatch) -> World:
    made = make_world(tmp_path, stub_tools)
    monkeypatch.setenv("PATH", f"{made.stubs}{os.pathsep}{os.environ.get('PATH', '/usr/bin:/bin')}")
    monkeypatch.setenv("HPC_SECURITY_WORLD", str(made.root))  # where the sbatch stub puts what it was given
    monkeypatch.setenv("HOME", str(made.home))
    monkeypatch.setenv("TMPDIR", str(made.tmp))
    monkeypatch.setattr(tempfile, "tempdir", str(made.tmp))
    monkeypatch.setenv("COLUMNS", "250")  # rich: one value per line, so literal text is not folded
    for name in ("HPC_TRAIN_SITE_PATH", "SLURM_JOB_ID", "SLURM_CONF", "BASH_ENV", "ENV"):
        monkeypatch.delenv(name, raising=False)
    return made
