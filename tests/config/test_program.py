"""``job.program``, ``job.args`` and ``[params]`` on the login node: the forms taken apart, files and modules
looked for without importing them, relative paths made absolute from the config file's folder, and every bad
value refused with exit status 2 before anything is written."""

from __future__ import annotations

import datetime
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from hpc_train.config.job import JobConfig
from hpc_train.config.loader import build
from hpc_train.config.overrides import apply_overrides
from hpc_train.config.params import check_params
from hpc_train.config.program import Program, check_program, parse_program, resolve_program
from hpc_train.errors import ConfigError
from hpc_train.login import submit
from tests.conftest import call_cli


@pytest.mark.parametrize(("value", "expected"), [
    ("train", Program("train")),
    ("smoke", Program("smoke")),
    ("mypkg.train:main", Program("module", module="mypkg.train", function="main")),
    ("loop.py:main", Program("file", path="loop.py", function="main")),
    ("code/loop:main", Program("file", path="code/loop", function="main")),
    ("scripts/train.py", Program("script", path="scripts/train.py")),
])
def test_the_forms_are_taken_apart(value: str, expected: Program) -> None:
    assert parse_program(value) == expected
    assert parse_program(value).text() == value


@pytest.mark.parametrize(("value", "says"), [
    ("a:b:c", 'more than one ":"'),
    (":f", "names no module or file"),
    ("mod:", "names no function"),
    ("my-pkg.train:main", 'is not a module name ("my-pkg")'),
    ("pkg..mod:main", 'is not a module name ("")'),
    ("mod:2main", "is not a Python name"),
    ("tran", "is not a program"),
    ("loop.py:main\nrm -rf /", "control character"),
])
def test_malformed_entry_points_are_refused_naming_the_value(value: str, says: str) -> None:
    bad = check_program(value)
    assert bad is not None and says in bad[0], bad
    with pytest.raises(ConfigError, match=r"^job\.program: ") as error:
        parse_program(value)
    assert "Fix:" in str(error.value)


def test_relative_files_are_made_absolute_from_the_config_folder(tmp_path: Path) -> None:
    (tmp_path / "code").mkdir()
    (tmp_path / "code" / "loop.py").write_text("def main(ctx):\n    pass\n")
    (tmp_path / "run.py").write_text("print('hi')\n")
    assert resolve_program("code/loop.py:main", tmp_path) == f"{tmp_path}/code/loop.py:main"
    assert resolve_program("run.py", tmp_path) == f"{tmp_path}/run.py"
    assert resolve_program("train", tmp_path) == "train"


def test_modules_are_found_without_importing_them(tmp_path: Path) -> None:
    package = tmp_path / "mypkg"
    package.mkdir()
    (package / "__init__.py").write_text("raise SystemExit('imported on the login node')\n")
    (package / "loop.py").write_text("def main(ctx):\n    pass\n")
    assert resolve_program("mypkg.loop:main", tmp_path) == "mypkg.loop:main"
    assert resolve_program("json.decoder:JSONDecoder", tmp_path) == "json.decoder:JSONDecoder"  # installed
    assert "mypkg" not in sys.modules
    with pytest.raises(ConfigError, match=r'module "mypkg\.nope" of "mypkg\.nope:main" is found neither'):
        resolve_program("mypkg.nope:main", tmp_path)
    with pytest.raises(ConfigError, match='module "nosuchpackage_xyz"'):
        resolve_program("nosuchpackage_xyz:main", tmp_path)


def test_missing_files_are_refused_naming_the_path(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as error:
        resolve_program("train_typo.py", tmp_path)
    assert f"script {tmp_path}/train_typo.py" in str(error.value)
    assert f"from the config file's folder {tmp_path}" in str(error.value)
    (tmp_path / "code.py").mkdir()
    with pytest.raises(ConfigError, match="is a folder, not a file"):
        resolve_program("code.py:main", tmp_path)


def test_a_fifo_or_a_device_is_named_for_what_it_is(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "train.py")
    with pytest.raises(ConfigError) as error:
        resolve_program("train.py", tmp_path)
    assert str(error.value).startswith(f'job.program: script {tmp_path}/train.py of "train.py" is a named pipe (FIFO), '
                                       "not a file. Fix: give a Python file")
    (tmp_path / "dev").mkdir()
    os.symlink("/dev/null", tmp_path / "dev" / "null.py")
    with pytest.raises(ConfigError, match=r"null\.py of \"dev/null\.py\" is a character device, not a file"):
        resolve_program("dev/null.py", tmp_path)


def test_params_take_toml_values_and_refuse_dates() -> None:
    good = {"lr": 1e-3, "name": "x", "layers": [1, 2], "nested": {"a": {"b": True}}, "rows": [{"x": 1}]}
    assert check_params(good) is None
    assert check_params({"when": datetime.date(2026, 12, 1)}) == (
        ".when", "is a date (datetime.date(2026, 12, 1)), which plan.json cannot carry as it is",
        'quote it: "2026-12-01"')
    assert check_params({"a": [1, {"b": object()}]})[0] == ".a[1].b"
    config = build(JobConfig, {"params": good, "job": {"args": ["--epochs", "2"]}})
    assert config.params == good and config.job.args == ["--epochs", "2"]
    with pytest.raises(ConfigError, match=r"^params\.when: is a date"):
        build(JobConfig, {"params": {"when": datetime.date(2026, 12, 1)}})
    with pytest.raises(ConfigError, match=r"^job\.args\[1\]: expected a string, got 2"):
        build(JobConfig, {"job": {"args": ["--epochs", 2]}})


def test_set_params_is_typed_like_the_file() -> None:
    data = apply_overrides({}, ["params.lr=3e-4", "params.name=abc", "params.layers=[1, 2]", "params.on=true"],
                           JobConfig)
    assert data["params"] == {"lr": 3e-4, "name": "abc", "layers": [1, 2], "on": True}


def _submit(tmp_path: Path, *extra: str) -> tuple[int, str]:
    result = call_cli(submit.main, ["job.toml", "--site", "local", *extra], tmp_path)
    return result.code, result.out + result.err


@pytest.mark.parametrize(("toml", "says"), [
    ('program = "a:b:c"', 'job.program: "a:b:c" has more than one ":"'),
    ('program = ":f"', 'job.program: ":f" names no module or file'),
    ('program = "my-pkg:main"', 'job.program: "my-pkg" in "my-pkg:main" is not a module name'),
    ('program = "missing.py"', "job.program: script {tmp}/missing.py of \"missing.py\" does not exist"),
    ('program = "nosuchmod_xyz:main"', 'job.program: module "nosuchmod_xyz" of "nosuchmod_xyz:main"'),
    ('program = "run.py"\nargs = ["--n", 3]', "job.args[1]: expected a string, got 3"),
    ('program = "run.py"\n[params]\nday = 2026-12-01', "params.day: is a date"),
])
def test_bad_programs_exit_2_and_write_nothing(tmp_path: Path, job_file: Callable[[str], Path], toml: str,
                                               says: str) -> None:
    (tmp_path / "run.py").write_text("print('hi')\n")
    job, _, rest = toml.partition("\n[params]")
    job_file(f"[job]\n{job}\n" + (f"[params]{rest}\n" if rest else ""))
    code, said = _submit(tmp_path)
    assert code == 2, said
    assert said.count("error:") == 1 and says.format(tmp=tmp_path) in said and "Traceback" not in said, said
    assert not (tmp_path / "runs").exists()


def test_the_plan_records_the_program_absolute_and_its_folder(tmp_path: Path,
                                                              job_file: Callable[[str], Path]) -> None:
    (tmp_path / "code").mkdir()
    (tmp_path / "code" / "loop.py").write_text("def main(ctx):\n    pass\n")
    job_file('[job]\nprogram = "code/loop.py:main"\nargs = ["a"]\n[params]\nx = 1\n')
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    result = call_cli(submit.main, [str(tmp_path / "job.toml"), "--site", "local", "--dry-run", "--json"],
                      elsewhere)
    assert result.code == 0, result.err
    plan = json.loads(result.out)["plan"]
    assert plan["config"]["job"]["program"] == f"{tmp_path}/code/loop.py:main"
    assert plan["code_dir"] == str(tmp_path)
    assert plan["config"]["params"] == {"x": 1} and plan["config"]["job"]["args"] == ["a"]
