"""Regression cases of issue 39 at the login node: outputs that are not plain files, a reader of stdout that
leaves (``| head``), NaN in ``--json``, and user-typed text echoed in errors.

Why: ``plot --out`` naming a FIFO hung (svg) or failed with an unexpected error (png); ``render --out`` that could
not be written made the run folder first; ``status --json | head`` ended "an unexpected failure
(BrokenPipeError)", exit 1, with an error file in /tmp; ``--json`` printed ``NaN``, which is not JSON; and an
escape sequence typed as an unknown argument reached the terminal raw.
"""

from __future__ import annotations

import io
import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from hpc_train.login import main as hpc_main
from hpc_train.login.cli.common import EXIT_PIPE, run_command
from tests.conftest import REPO, call_cli

EXAMPLE = str(REPO / "examples" / "tiny_gpt.toml")


def _errors(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("error:")]


# -- outputs ---------------------------------------------------------------------------------------------------


def _render_out(tmp_path: Path, out: str) -> tuple[int, str]:
    result = call_cli(hpc_main.main, ["render", EXAMPLE, "--site", "local-slurm", "--out", out], tmp_path)
    return result.code, result.err


@pytest.mark.parametrize(("label", "out", "says"), [
    ("fifo", "@/out.sbatch", "is a named pipe (FIFO)"),
    ("missing-folder", "@/no/such/out.sbatch", "does not exist"),
    ("device", "/dev/null", "is a device"),
    ("link", "@/link.sbatch", "is a symbolic link"),
    ("under-a-file", "@/plain.txt/out.sbatch", "cannot be used"),
    ("folder", "@", "is a folder"),
])
def test_render_refuses_an_output_before_it_makes_the_run_folder(tmp_path: Path, label: str, out: str,
                                                                  says: str) -> None:
    os.mkfifo(tmp_path / "out.sbatch")
    (tmp_path / "link.sbatch").symlink_to(tmp_path / "victim")
    (tmp_path / "plain.txt").write_text("x")
    code, err = _render_out(tmp_path, out.replace("@", str(tmp_path)))
    assert code == 2 and len(_errors(err)) == 1 and says in err and "--out" in err, err
    assert not (tmp_path / "runs").exists() and not (tmp_path / "victim").exists()


def test_render_writes_an_output_through_a_temporary_file_and_rename(tmp_path: Path) -> None:
    (tmp_path / "job.sbatch").write_text("old")
    code, err = _render_out(tmp_path, str(tmp_path / "job.sbatch"))
    assert code == 0, err
    assert (tmp_path / "job.sbatch").read_text().startswith("#!/bin/bash")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["job.sbatch", "runs"]


@pytest.mark.parametrize("suffix", [".svg", ".png"])
def test_plot_refuses_a_fifo_at_once(tmp_path: Path, suffix: str) -> None:
    """In a subprocess: a regression would block on the FIFO for ever."""
    fifo = tmp_path / f"plot{suffix}"
    os.mkfifo(fifo)
    result = subprocess.run([sys.executable, "-m", "hpc_train", "plot", str(tmp_path / "nowhere"), "--out", str(fifo)],
                            cwd=tmp_path, capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 2 and len(_errors(result.stderr)) == 1, result.stderr
    assert "is a named pipe (FIFO)" in result.stderr and "unexpected" not in result.stderr


def test_bench_and_ckpt_export_refuse_a_fifo_before_any_work(tmp_path: Path) -> None:
    fifo = tmp_path / "out.json"
    os.mkfifo(fifo)
    bench = call_cli(hpc_main.main, ["bench", "allreduce", "--out", str(fifo)], tmp_path)
    assert bench.code == 2 and "is a named pipe (FIFO)" in bench.err, bench.err
    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o700)
    (run_dir / "plan.json").write_text("{}")
    for fmt in ("pt", "safetensors", "hf"):
        export = call_cli(hpc_main.main, ["ckpt", "export", str(run_dir), "--out", str(fifo), "--format", fmt,
                                          "--force"], tmp_path)
        assert export.code == 2 and "--out" in export.err and "FIFO" in export.err, export.err
    assert sorted(p.name for p in run_dir.iterdir()) == ["plan.json"]


# -- a reader of stdout that leaves ----------------------------------------------------------------------------


@pytest.mark.parametrize("args", [["validate", EXAMPLE, "--json"], ["validate", EXAMPLE],
                                  ["render", EXAMPLE, "--site", "local-slurm", "--stdout"]],
                         ids=["json", "rich", "print"])
def test_a_closed_pipe_ends_quietly_with_141_and_no_error_file(tmp_path: Path, args: list[str]) -> None:
    """As ``yes | head`` ends: no message, no error file, 128 + SIGPIPE. The pipe is closed before the command
    writes a byte, so every write finds no reader."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = {**os.environ, "TMPDIR": str(tmp)}
    child = subprocess.Popen([sys.executable, "-m", "hpc_train", *args], cwd=tmp_path, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, env=env)
    assert child.stdout is not None and child.stderr is not None
    child.stdout.close()
    err = child.stderr.read().decode()
    assert child.wait(timeout=60) == EXIT_PIPE == 141
    assert err == "" and list(tmp.iterdir()) == []


def _in_process(command: object, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> tuple[int, str]:
    import contextlib

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        code = run_command(command)  # type: ignore[arg-type]
    return code, err.getvalue()


def test_a_broken_pipe_that_is_not_stdout_is_still_a_failure(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    def broken() -> int:
        raise BrokenPipeError(32, "Broken pipe")  # a subprocess or socket of the command's own

    code, err = _in_process(broken, monkeypatch, tmp_path)
    assert code == 1 and "an unexpected failure (BrokenPipeError" in err


def test_rich_ending_a_broken_pipe_is_the_same_quiet_141(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    def rich_on_broken_pipe() -> int:
        try:
            raise BrokenPipeError(32, "Broken pipe")
        except BrokenPipeError:
            raise SystemExit(1) from None  # what rich.console.Console.on_broken_pipe does

    code, err = _in_process(rich_on_broken_pipe, monkeypatch, tmp_path)
    assert code == 141 and err == "" and list(tmp_path.iterdir()) == []


# -- strict JSON -----------------------------------------------------------------------------------------------


def _strict(text: str) -> object:
    def refuse(constant: str) -> float:
        raise ValueError(f"{constant} is not JSON")

    return json.loads(text, parse_constant=refuse)


def test_status_json_is_strict_with_nan_and_infinity_in_the_metrics(tmp_path: Path) -> None:
    assert call_cli(hpc_main.main, ["render", EXAMPLE, "--site", "local-slurm"], tmp_path).code == 0
    run_dir = tmp_path / "runs" / "tiny-gpt"
    (run_dir / "metrics.jsonl").write_text('{"step": 1, "time": 1.0, "loss": NaN, "lr": Infinity, '
                                           '"tokens_per_s": -Infinity}\n')
    result = call_cli(hpc_main.main, ["status", str(run_dir), "--json"], tmp_path)
    assert result.code == 0, result.err
    _strict(result.out)


def test_the_json_printer_never_writes_nan(capsys: pytest.CaptureFixture[str]) -> None:
    from hpc_train.common.terminal import print_json

    print_json({"loss": math.nan})
    assert _strict(capsys.readouterr().out) == {"loss": None}


# -- user text in errors ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("args", [
    ["validate", EXAMPLE, "--x\x1b]0;pwned\x07"],
    ["\x1b[2J"],
    ["validate", "job\x1b[31m.toml"],
    ["validate", "job.toml\nerror: a fake second message"],
    ["status", "--watch", "\x9b2J"],
], ids=["unknown-argument", "unknown-command", "config-path", "config-path-newline", "bad-number"])
def test_text_the_user_typed_is_echoed_escaped_on_one_line(tmp_path: Path, args: list[str]) -> None:
    result = call_cli(hpc_main.main, args, tmp_path)
    assert result.code == 2
    assert not any(char in result.err + result.out for char in "\x1b\x9b\x07")
    assert len(_errors(result.err)) == 1, result.err
