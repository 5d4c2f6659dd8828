"""Every number of the job and site schemas has a range, checked when the file is read: a value beyond any
machine or run is one line naming the key and the range, exit 2 (it once went on into arithmetic and ended
in OverflowError, or was rendered into #SBATCH lines as it was)."""

from __future__ import annotations

import dataclasses
import types
import typing
from pathlib import Path
from typing import Any, get_args, get_origin

import pytest

from hpc_train.config.job import JobConfig
from hpc_train.config.loader import field_types
from hpc_train.config.site import SiteConfig
from hpc_train.login import main as hpc_main
from tests.conftest import call_cli


def _numeric(kind: Any) -> bool:
    if get_origin(kind) in (types.UnionType, typing.Union, list):
        return any(_numeric(arg) for arg in get_args(kind))
    return kind in (int, float)


def numeric_fields(root: type, prefix: str = "") -> list[tuple[str, dataclasses.Field[Any]]]:
    found = []
    hints = field_types(root)
    for item in dataclasses.fields(root):
        kind, where = hints[item.name], f"{prefix}{item.name}"
        if dataclasses.is_dataclass(kind):
            found += numeric_fields(kind, f"{where}.")
        elif _numeric(kind):
            found.append((where, item))
    return found


@pytest.mark.parametrize("root", [JobConfig, SiteConfig])
def test_every_numeric_key_declares_a_range(root: type) -> None:
    missing = [where for where, item in numeric_fields(root) if item.metadata.get("range") is None]
    assert not missing, f"numeric keys without a Range: {missing}"
    assert len(numeric_fields(root)) > (40 if root is JobConfig else 8)


JOB_NUMBERS = [where for where, _ in numeric_fields(JobConfig)]


@pytest.mark.parametrize("key", JOB_NUMBERS)
@pytest.mark.parametrize("value", ["4611686018427387904", "-9223372036854775808", "1e308"])
def test_a_number_beyond_its_range_is_one_line_naming_the_key_and_range(key: str, value: str,
                                                                        tmp_path: Path) -> None:
    if key == "train.seed" and value == str(2**62):
        return  # a seed takes any 63-bit number
    job = tmp_path / "job.toml"
    job.write_text(f'[job]\nrun_root = "{tmp_path}/runs"\n')
    result = call_cli(hpc_main.main, ["validate", str(job), "--site", "local", "--set", f"{key}={value}"], tmp_path)
    assert result.code == 2, result.err
    errors = [line for line in result.err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith(f"error: {key}: "), result.err
    assert "unexpected" not in result.err and "Traceback" not in result.err
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize(("key", "value", "says"), [
    ("job.spare_nodes", str(2**62), "job.spare_nodes: 4611686018427387904 is above the maximum 100,000. Fix: give "
     "a value from 0 to 100,000"),
    ("checkpoint.every_minutes", "1e308", "checkpoint.every_minutes: 1e+308 is above the maximum 525,600"),
    ("dist.timeout_s", str(2**40), "dist.timeout_s: 1099511627776 is above the maximum 604,800"),
    ("train.seed", "-1", "train.seed: -1 is below the minimum 0"),
])
def test_the_message_names_the_range(key: str, value: str, says: str, tmp_path: Path) -> None:
    job = tmp_path / "job.toml"
    job.write_text("")
    result = call_cli(hpc_main.main, ["validate", str(job), "--site", "local", "--set", f"{key}={value}"], tmp_path)
    assert result.code == 2 and says in result.err, result.err


def test_a_site_number_beyond_its_range_names_the_site(tmp_path: Path) -> None:
    site = tmp_path / "big.toml"
    site.write_text('name = "big"\n[slurm]\nenabled = false\n[reliability]\nnode_mtbf_hours = 1e308\n')
    job = tmp_path / "job.toml"
    job.write_text("")
    result = call_cli(hpc_main.main, ["validate", str(job), "--site", str(site)], tmp_path)
    assert result.code == 2 and "reliability.node_mtbf_hours: 1e+308 is above the maximum" in result.err, result.err
