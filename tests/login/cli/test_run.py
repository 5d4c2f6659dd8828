"""``hpc_train run``: flags as ``[job]`` keys, the target as the program, what follows as its arguments; a
whole run of an unmodified DDP script on the local executor from one line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hpc_train.errors import ConfigError
from hpc_train.login.cli.run import run_overrides
from hpc_train.login.main import _build_parser
from tests.conftest import REPO

DDP = str(REPO / "examples" / "ddp_script" / "train_cnn.py")


def _parsed(*argv: str) -> list[str]:
    return run_overrides(_build_parser().parse_args(["run", *argv]))


def test_the_flags_are_job_keys_and_what_follows_the_script_is_its_own() -> None:
    overrides = _parsed("--nodes", "2", "--time", "01:00:00", "--set", "train.seed=3", "train.py", "--lr", "3e-4",
                        "--nodes", "9")
    assert overrides == ["job.program=train.py", 'job.args=["--lr", "3e-4", "--nodes", "9"]', "job.name=train",
                         "job.nodes=2", "job.time=01:00:00", "train.seed=3"]
    assert "job.name=loop-main" in _parsed("loop.py:main")
    assert "job.name=mod-main" in _parsed("pkg.mod:main")
    assert _parsed("--name", "mine", "pkg.mod:main") == ["job.program=pkg.mod:main", "job.args=[]", "job.name=mine"]


def test_a_flag_where_the_script_belongs_is_refused_naming_the_order() -> None:
    args = _build_parser().parse_args(["run", "train.py"])
    args.target = "--lr"
    with pytest.raises(ConfigError, match="put hpc_train's flags before the script"):
        run_overrides(args)


def test_a_missing_script_exits_2_and_writes_nothing(tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, "-m", "hpc_train", "run", "--tasks-per-node", "2", "nope.py"],
                            cwd=tmp_path, capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 2 and "nope.py" in result.stderr and "Traceback" not in result.stderr
    assert not list(tmp_path.iterdir())


@pytest.mark.slow
def test_an_unmodified_ddp_script_runs_from_one_line_with_its_arguments(tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, "-m", "hpc_train", "run", "--tasks-per-node", "2", DDP, "--epochs", "1",
                             "--out", "weights.pt"], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                            check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "epoch 0: mean loss" in result.stdout and "completed" in result.stdout
    plan = json.loads((tmp_path / "runs" / "train_cnn" / "plan.json").read_text())
    assert plan["config"]["job"]["args"] == ["--epochs", "1", "--out", "weights.pt"]
    assert plan["config"]["job"]["program"] == DDP
