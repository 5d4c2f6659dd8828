"""``python -m hpc_train render`` and ``validate``: what they write, where, and with which permissions."""

from __future__ import annotations

import json
import stat
from pathlib import Path

from hpc_train.config.plan import Plan
from hpc_train.login import main as hpc_main
from tests.conftest import REPO, call_cli

EXAMPLE = str(REPO / "examples" / "tiny_gpt.toml")


def test_render_writes_a_private_run_folder(tmp_path: Path) -> None:
    result = call_cli(hpc_main.main, ["render", EXAMPLE, "--site", "local-slurm", "--template", "mpirun", "--json"],
                      tmp_path)
    assert result.code == 0, result.err
    paths = json.loads(result.out)
    run_dir, script = Path(paths["run_dir"]), Path(paths["script"])
    assert run_dir == tmp_path / "runs" / "tiny-gpt" and script == run_dir / "job-mpirun.sbatch"
    assert stat.S_IMODE(run_dir.stat().st_mode) == 0o700
    assert stat.S_IMODE((run_dir / "logs").stat().st_mode) == 0o700
    assert stat.S_IMODE(script.stat().st_mode) == 0o700
    plan = Plan.from_json((run_dir / "plan.json").read_text())
    assert plan.launcher == "srun" and plan.layout.world == 2
    assert "[job]" in (run_dir / "config.toml").read_text()
    assert "mpirun -np" in script.read_text()


def test_render_to_stdout_writes_nothing(tmp_path: Path) -> None:
    result = call_cli(hpc_main.main, ["render", EXAMPLE, "--site", "local-slurm", "--stdout"], tmp_path)
    assert result.code == 0 and result.out.startswith("#!/bin/bash -l\n")
    assert list(tmp_path.iterdir()) == []


def test_render_refuses_a_world_writable_run_folder(tmp_path: Path) -> None:
    shared = tmp_path / "runs" / "tiny-gpt"
    shared.mkdir(parents=True)
    shared.chmod(0o777)
    result = call_cli(hpc_main.main, ["render", EXAMPLE, "--site", "local-slurm"], tmp_path)
    assert result.code == 2 and "is writable by others" in result.err and "chmod go-w" in result.err
    assert list(shared.iterdir()) == []


def test_rerender_with_a_changed_config_keeps_the_old_one(tmp_path: Path) -> None:
    first = call_cli(hpc_main.main, ["render", EXAMPLE, "--site", "local-slurm"], tmp_path)
    second = call_cli(hpc_main.main, ["render", EXAMPLE, "--site", "local-slurm", "--set", "train.lr=1e-4"], tmp_path)
    assert first.code == second.code == 0
    run_dir = tmp_path / "runs" / "tiny-gpt"
    kept = list(run_dir.glob("config.*.toml"))
    assert len(kept) == 1 and "lr = 0.001" in kept[0].read_text()
    assert "lr = 0.0001" in (run_dir / "config.toml").read_text()


def test_validate_prints_the_layout(tmp_path: Path) -> None:
    result = call_cli(hpc_main.main, ["validate", EXAMPLE, "--site", "local", "--set", "job.tasks_per_node=4",
                                      "--set", "parallel.tensor=2"], tmp_path)
    assert result.code == 0, result.err
    assert "world" in result.out and "4 = tensor 2 x pipeline 1 x data 2" in result.out
    assert "valid for site local" in result.out


def test_render_needs_no_slurm_on_this_machine(tmp_path: Path) -> None:
    """A laptop renders scripts for a cluster: no sbatch on PATH is fine."""
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-m", "hpc_train", "render", EXAMPLE, "--site", "ndr-h100", "--stdout",
                             "--set", "job.tasks_per_node=8"], cwd=tmp_path, env={"PATH": "/nonexistent"},
                            capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stderr
    assert "#SBATCH --gpus-per-node=8" in result.stdout


def test_a_corrupt_plan_in_the_run_folder_is_kept_aside(tmp_path: Path) -> None:
    run_dir = tmp_path / "runs" / "tiny-gpt"
    run_dir.mkdir(parents=True, mode=0o700)
    (run_dir / "plan.json").write_text("{not json")
    (run_dir / "config.toml").write_text("# an older config\n")
    result = call_cli(hpc_main.main, ["render", EXAMPLE, "--site", "local-slurm"], tmp_path)
    assert result.code == 0, result.err
    assert (run_dir / "config.unknown.toml").read_text() == "# an older config\n"
    assert Plan.from_json((run_dir / "plan.json").read_text()).name == "tiny-gpt"


def test_validate_and_memory_need_no_slurm_on_this_machine(tmp_path: Path) -> None:
    """A laptop checks a cluster job: validate and validate --memory never look for sbatch."""
    import subprocess
    import sys

    for extra in ([], ["--memory"]):
        result = subprocess.run([sys.executable, "-m", "hpc_train", "validate", EXAMPLE, "--site", "ndr-h100",
                                 "--set", "job.tasks_per_node=8", "--set", "train.model=125M", *extra], cwd=tmp_path,
                                env={"PATH": "/nonexistent"}, capture_output=True, text=True, timeout=60, check=False)
        assert result.returncode == 0, result.stderr
    assert "fits in" in result.stdout and "optimizer state" in result.stdout


def test_validate_memory_at_another_world_plans_memory_at_that_size(tmp_path: Path) -> None:
    """``--memory --world 64`` once printed the layout and dropped the memory plan without a word: it is the
    memory plan at 64 ranks now (32 nodes of the job's 2 tasks), and a size that is no whole number of nodes is
    refused naming the shape."""
    result = call_cli(hpc_main.main, ["validate", EXAMPLE, "--site", "local", "--memory", "--world", "64", "--json"],
                      tmp_path)
    assert result.code == 0, result.err
    memory = json.loads(result.out)
    assert memory["data"] == 64 and memory["tensor"] == 1, memory
    odd = call_cli(hpc_main.main, ["validate", EXAMPLE, "--site", "local", "--memory", "--world", "63"], tmp_path)
    assert odd.code == 2 and "63 ranks is not a whole number of nodes of 2 tasks" in odd.err, odd.err


def test_render_says_when_it_creates_the_run_root(tmp_path: Path) -> None:
    """A site's run root made on a laptop (``/shared/...``) was created without a word."""
    first = call_cli(hpc_main.main, ["render", EXAMPLE, "--site", "local-slurm", "--json"], tmp_path)
    assert first.code == 0, first.err
    assert json.loads(first.out)["created_run_root"] == str(tmp_path / "runs")
    again = call_cli(hpc_main.main, ["render", EXAMPLE, "--site", "local-slurm"], tmp_path)
    assert again.code == 0 and "created the run root" not in again.out and again.out.startswith("wrote "), again.out
    said = call_cli(hpc_main.main, ["render", EXAMPLE, "--site", "local-slurm", "--set", "job.run_root=new-root"],
                    tmp_path)
    assert said.out.startswith(f"created the run root {tmp_path / 'new-root'} (it did not exist here"), said.out
