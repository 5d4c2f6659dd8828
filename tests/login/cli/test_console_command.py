"""The ``hpc_train`` console script: ``hpc_train submit`` is ``python -m hpc_train.submit`` (same output, same exit
status, bad input included), and ``hpc_train --help`` names every command with one line."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO

CONSOLE = Path(sys.executable).parent / "hpc_train"  # installed by the editable install's entry point
EXAMPLE = str(REPO / "examples" / "tiny_gpt.toml")
COMMANDS = ("submit", "run", "validate", "render", "ckpt", "bench", "logs", "status", "cancel", "plot", "doctor")
CASES = {
    "dry-run": [EXAMPLE, "--site", "local", "--dry-run"],
    "dry-run-json": [EXAMPLE, "--site", "local", "--dry-run", "--json"],
    "unknown-key": [EXAMPLE, "--site", "local", "--dry-run", "--set", "train.stpes=3"],
    "world-does-not-factor": [EXAMPLE, "--site", "local", "--dry-run", "--set", "parallel.tensor=3"],
    "missing-config": ["nope.toml", "--site", "local"],
    "unknown-flag": [EXAMPLE, "--site", "local", "--frobnicate"],
    "help": ["--help"],
}


def _run(argv: list[str], cwd: Path) -> tuple[int, str, str]:
    result = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=60, check=False)
    return result.returncode, result.stdout, result.stderr


def _same_program_name(text: str) -> str:
    """Usage lines name what was typed (and wrap at another column for it); the rest must be identical."""
    return " ".join(re.sub(r"(python -m hpc_train\.submit|hpc_train submit)", "PROG", text).split())


@pytest.mark.parametrize("args", CASES.values(), ids=CASES.keys())
def test_the_subcommand_is_the_module_entry_point(tmp_path: Path, args: list[str]) -> None:
    module = _run([sys.executable, "-m", "hpc_train.submit", *args], tmp_path)
    console = _run([str(CONSOLE), "submit", *args], tmp_path)
    assert console[0] == module[0], (console, module)
    assert _same_program_name(console[1]) == _same_program_name(module[1])
    assert _same_program_name(console[2]) == _same_program_name(module[2])
    assert list(tmp_path.iterdir()) == []  # a dry run and a refusal write nothing
    expected = {"unknown-key": 2, "world-does-not-factor": 2, "missing-config": 2, "unknown-flag": 2}
    assert module[0] == expected.get(next(k for k, v in CASES.items() if v == args), 0), module


def test_help_lists_every_command_with_one_line(tmp_path: Path) -> None:
    code, out, _ = _run([str(CONSOLE), "--help"], tmp_path)
    assert code == 0 and out.startswith("usage: hpc_train ")
    listed = re.findall(r"^    (\w+)\s+\S", out, flags=re.MULTILINE)
    assert listed == list(COMMANDS), out
    code, out, _ = _run([sys.executable, "-m", "hpc_train", "--help"], tmp_path)
    assert code == 0 and out.startswith("usage: python -m hpc_train ")
