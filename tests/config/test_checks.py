"""Per-value checks: Slurm time syntax, and the character rules that keep values on their line."""

from __future__ import annotations

import pytest

from hpc_train.config import checks


@pytest.mark.parametrize(("text", "seconds"), [
    ("30", 1800), ("10:30", 630), ("01:00:00", 3600), ("2-00", 172800), ("1-12:30", 131400),
    ("1-00:00:01", 86401), ("90", 5400),
])
def test_time_formats_slurm_accepts(text: str, seconds: int) -> None:
    assert checks.parse_time_seconds(text) == seconds


@pytest.mark.parametrize("text", ["", "abc", "1:99:00", "2-30", "01:00:60", "1h", "-5", "1:2:3:4", "UNLIMITED"])
def test_time_formats_refused(text: str) -> None:
    assert checks.parse_time_seconds(text) is None


def test_time_under_a_minute_is_refused_with_the_fix() -> None:
    problem, fix = checks.check_time("00:00:30")
    assert "under one minute" in problem and "00:10:00" in fix


@pytest.mark.parametrize("check", [checks.check_slurm_name, checks.check_path, checks.check_hostlist,
                                   checks.check_constraint, checks.check_mem, checks.check_module,
                                   checks.check_env_value])
@pytest.mark.parametrize("value", ["a\nb", "a\rb", "a\x00b", "a\tb", "a\x7fb", "x\n#SBATCH --uid=0"])
def test_control_characters_refused_everywhere(check: checks.Check, value: str) -> None:
    bad = check(value)
    assert bad is not None and "control character" in bad[0]


@pytest.mark.parametrize("value", ["gpt-125m", "run_1.2", "a+b"])
def test_slurm_names_accept_plain_identifiers(value: str) -> None:
    assert checks.check_slurm_name(value) is None


@pytest.mark.parametrize("value", ["a b", "$(id)", "`id`", "a;b", "'q'", "-leading", "x" * 129])
def test_slurm_names_refuse_shell(value: str) -> None:
    assert checks.check_slurm_name(value) is not None


def test_usr1_refused_with_reason() -> None:
    problem, fix = checks.check_signal("SIGUSR1")
    assert "NCCL" in problem and "USR2" in fix
    assert checks.check_signal("usr2") is None
    assert checks.check_signal("KILL") is not None
