"""Login-node commands answer at once: each runs in a fresh interpreter and must not import torch/deepspeed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hpc_train.checkpoint import CheckpointManager
from tests.conftest import REPO

HARNESS = """
import json, runpy, sys
sys.argv = json.loads(sys.argv[1])
code = 0
try:
    runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
except SystemExit as exit_:
    code = exit_.code or 0
heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "deepspeed", "numpy", "mpi4py"))
print("HEAVY=" + json.dumps(heavy[:5]), "CODE=" + str(code), file=sys.stderr)
"""
EXAMPLE = str(REPO / "examples" / "tiny_gpt.toml")
COMMANDS = {
    "submit-help": ["hpc_train.submit", "--help"],
    "submit-dry-run": ["hpc_train.submit", EXAMPLE, "--site", "local", "--dry-run"],
    "submit-dry-run-json": ["hpc_train.submit", EXAMPLE, "--site", "local-slurm", "--dry-run", "--json",
                            "--executor", "local"],
    "main-help": ["hpc_train", "--help"],
    "main-submit-dry-run": ["hpc_train", "submit", EXAMPLE, "--site", "local", "--dry-run"],
    "validate": ["hpc_train", "validate", EXAMPLE, "--site", "local"],
    "render-stdout": ["hpc_train", "render", EXAMPLE, "--site", "local-slurm", "--stdout"],
    "bad-config": ["hpc_train", "validate", EXAMPLE, "--site", "local", "--set", "job.nodes=0"],
    "ckpt-export-help": ["hpc_train", "ckpt", "export", "--help"],
}


@pytest.mark.parametrize("argv", COMMANDS.values(), ids=COMMANDS.keys())
def test_command_imports_no_torch(tmp_path: Path, argv: list[str]) -> None:
    result = subprocess.run([sys.executable, "-c", HARNESS, json.dumps(argv)], cwd=tmp_path, capture_output=True,
                            text=True, timeout=60, check=False)
    last = result.stderr.strip().splitlines()[-1]
    assert "HEAVY=[]" in last, result.stderr
    expected = "CODE=2" if "job.nodes=0" in argv else "CODE=0"
    assert expected in last, result.stdout + result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # none of these writes anything


def _committed_run(run: Path) -> None:
    """Two committed checkpoints of placeholder files (ls and verify read manifests, sizes and hashes only)."""
    manager = CheckpointManager(run / "checkpoints", keep=2)
    for step in (2, 4):
        tmp = manager.begin(step)
        (tmp / "state").mkdir()
        (tmp / "state" / "mp_rank_00_model_states.pt").write_bytes(b"x" * step)
        manager.commit(tmp, {"world_size": 2, "layout": {"tensor": 1, "pipeline": 1, "data": 2, "context": 1},
                             "zero_stage": 2, "dtype": "fp32", "config_hash": "h"})


CKPT_COMMANDS = {"ls": ["ls"], "ls-json": ["ls", "--json"], "verify": ["verify"],
                 "verify-sha256": ["verify", "--sha256"]}


@pytest.mark.parametrize("args", CKPT_COMMANDS.values(), ids=CKPT_COMMANDS.keys())
def test_ckpt_command_imports_no_torch(tmp_path: Path, args: list[str]) -> None:
    _committed_run(tmp_path / "run")
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    argv = ["hpc_train", "ckpt", args[0], str(tmp_path / "run"), *args[1:]]
    result = subprocess.run([sys.executable, "-c", HARNESS, json.dumps(argv)], cwd=tmp_path, capture_output=True,
                            text=True, timeout=60, check=False)
    last = result.stderr.strip().splitlines()[-1]
    assert "HEAVY=[]" in last and "CODE=0" in last, result.stdout + result.stderr
    assert "step-00000004" in result.stdout
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before  # they write nothing


def test_dry_run_json_is_the_plan(tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, "-m", "hpc_train.submit", EXAMPLE, "--site", "local", "--dry-run",
                             "--json"], cwd=tmp_path, capture_output=True, text=True, timeout=60, check=True)
    data = json.loads(result.stdout)
    assert data["plan"]["layout"]["world"] == 2 and data["plan"]["executor"] == "local"
    assert data["submitit"]["tasks_per_node"] == 2
    assert data["plan"]["run_dir"] == str(tmp_path / "runs" / "tiny-gpt")
