"""Shared helpers: write job/site files, run a CLI entry in-process and capture what it said."""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PYTHON = sys.executable


@dataclass
class CliResult:
    code: int
    out: str
    err: str


@contextlib.contextmanager
def chdir(path: Path) -> Iterator[None]:
    old = Path.cwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(old)


def call_cli(entry: Callable[[list[str]], int], args: list[str], cwd: Path) -> CliResult:
    """Run ``entry(args)`` in ``cwd``; SystemExit (argparse) counts as a return code."""
    out, err = io.StringIO(), io.StringIO()
    with chdir(cwd), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = entry(args)
        except SystemExit as exit_:
            code = exit_.code if isinstance(exit_.code, int) else 1
    return CliResult(code, out.getvalue(), err.getvalue())


@pytest.fixture
def job_file(tmp_path: Path) -> Callable[[str], Path]:
    """Write a job config into tmp_path and return its path."""

    def write(text: str, name: str = "job.toml") -> Path:
        path = tmp_path / name
        path.write_text(text, encoding="utf-8")
        return path

    return write


@pytest.fixture(autouse=True)
def _environment_kept() -> Iterator[None]:
    """What a test's in-process code exports (a rank's rendezvous variables, LOCAL_SIZE among them, or a plan's
    rank environment) leaves with the test: a later test in the same lane that starts torchrun must not inherit
    a LOCAL_SIZE of 1 for its 2 local ranks (DeepSpeed's shared-memory layer then aborts the process at exit)."""
    saved = dict(os.environ)
    yield
    if os.environ != saved:
        os.environ.clear()
        os.environ.update(saved)


def torchrun(args: list[str], cwd: Path, env: dict[str, str], timeout: float = 600,
             fresh: Path | None = None) -> subprocess.CompletedProcess[str]:
    """A plain ``torchrun --standalone --nproc_per_node=2`` baseline (the reference a test compares hpc_train with),
    run once more when a worker died by a signal: a gloo rank of these scripts aborted with "terminate called
    without an active exception" a few times while the other test lane loaded the machine (cause not found).
    ``fresh``: the script's own checkpoint folder, removed before each try so that a retry starts over."""
    import shutil

    result = None
    for _attempt in range(2):
        if fresh is not None:
            shutil.rmtree(fresh, ignore_errors=True)
        result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--standalone",
                                 *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout,
                                check=False)
        if "exitcode  : -" not in result.stderr:
            break
    assert result is not None
    return result


def free_port() -> int:
    """A TCP port nothing listens on now (for a torchrun baseline; its default 29500 may be another test's)."""
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])



def exported(run_dir: Path, out: Path, *extra: str) -> Path:
    """``python -m hpc_train ckpt export RUN_DIR --out OUT`` run in this process (the command's code without a
    new interpreter's 4 s of torch and DeepSpeed imports; tests/login/test_ckpt_cli.py runs the command itself)."""
    from hpc_train.login.main import main

    result = call_cli(main, ["ckpt", "export", str(run_dir), "--out", str(out), *extra], run_dir)
    assert result.code == 0, result.out + result.err
    return out


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Lanes for ``pytest -n 2 --dist loadgroup`` (scripts/test.sh): every test that uses the local Slurm cluster
    runs in one lane, one at a time (a test preempts with a higher-priority job and takes both nodes, so two of
    them at once would meet each other's jobs); every other file is a lane of its own, so a module's shared run
    is trained once. Without xdist the marks change nothing. ``tryfirst``: xdist's own hook turns the marks into
    the ``@group`` suffix its scheduler reads, so they must be there before it runs."""
    for item in items:
        uses_slurm = "slurm_cluster" in getattr(item, "fixturenames", ())
        file = item.nodeid.split("::")[0]
        item.add_marker(pytest.mark.xdist_group("slurm" if uses_slurm else file))


def pytest_xdist_node_collection_finished(node: object, ids: list[str]) -> None:
    """Refuse to run the lanes when xdist did not group the tests: every test then runs alone, module fixtures
    are built once per lane and Slurm tests of both lanes meet each other's jobs (pytest 9 with xdist 3.8 did
    this without a word: xdist renames ``item._nodeid``, which pytest 9 no longer reads; constraints/cpu.txt
    pins pytest). Called on the controller with each worker's collection."""
    dist = getattr(getattr(getattr(node, "config", None), "option", None), "dist", "loadgroup")
    if dist == "loadgroup" and ids and not any("@" in nodeid for nodeid in ids):
        import xdist

        raise pytest.UsageError(f"--dist loadgroup grouped none of the {len(ids)} tests: pytest "
                                f"{pytest.__version__} and pytest-xdist {xdist.__version__} do not work together; "
                                "run scripts/bootstrap.sh, which installs the pinned pytest")
