"""Every submission path against the real local Slurm cluster: 2 nodes x 2 ranks in one gloo group.

These start real jobs (slurmctld, slurmd n1/n2, slurmdbd); scripts/test.sh brings the cluster up first.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.slurm.cluster import wait_for_job

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("slurm_cluster")]
EXAMPLE = str(REPO / "examples" / "tiny_gpt.toml")
SMOKE = ["--set", "job.program=smoke"]  # these tests check the path, not the model
TWO_BY_TWO = ["--set", "job.nodes=2", "--set", "job.tasks_per_node=2", *SMOKE]


def _submit(tmp_path: Path, *args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "hpc_train.submit", EXAMPLE, *args], cwd=tmp_path,
                          capture_output=True, text=True, timeout=timeout, check=False)


def _job_ids(output: str) -> list[str]:
    return re.findall(r"submitted job (\S+) ", output)


def _sacct_state(job_id: str) -> str:
    out = subprocess.run(["sacct", "-n", "-P", "-X", "-j", job_id, "-o", "State"], capture_output=True, text=True,
                         check=True).stdout.split()
    return out[-1] if out else ""


def _check_smoke(run_dir: Path, world: int = 4, nodes: frozenset[str] = frozenset({"n1", "n2"})) -> dict:
    smoke = json.loads((run_dir / "smoke.json").read_text())
    assert smoke["world_size"] == world and smoke["all_reduce"] == world * (world - 1) / 2
    assert set(smoke["hosts"]) == nodes  # the group really spans both nodes
    assert smoke["groups"]["dp"] == list(range(world))  # rank 0's data-parallel group, checked by all-reduce
    assert smoke["num_nodes"] == 2
    return smoke


def test_submit_follows_a_two_node_job_to_completion(tmp_path: Path) -> None:
    result = _submit(tmp_path, "--site", "local-slurm", *TWO_BY_TWO)
    assert result.returncode == 0, result.stdout + result.stderr
    (job_id,) = _job_ids(result.stdout)
    # States are sampled by polling (backing off up to 5 s), so a 2-second job may go PENDING -> COMPLETED
    # between two polls: require the states it must show, and the rank-0 log followed as it grew.
    assert f"job {job_id}: " in result.stdout and f"job {job_id}: COMPLETED" in result.stdout
    assert "rank0 | " in result.stdout and "start: srun rank 0/4" in result.stdout
    assert f"job {job_id} completed" in result.stdout
    smoke = _check_smoke(tmp_path / "runs" / "tiny-gpt")
    assert smoke["launcher"] == "srun"
    assert _sacct_state(job_id) == "COMPLETED"


@pytest.mark.parametrize("template", ["srun", "torchrun", "mpirun"])
def test_rendered_template_runs_with_plain_sbatch(tmp_path: Path, template: str) -> None:
    rendered = subprocess.run([sys.executable, "-m", "hpc_train", "render", EXAMPLE, "--site", "local-slurm",
                               *TWO_BY_TWO, "--set", f"job.name=tpl-{template}", "--template", template, "--json"],
                              cwd=tmp_path, capture_output=True, text=True, timeout=60, check=True)
    script = json.loads(rendered.stdout)["script"]
    job_id = subprocess.run(["sbatch", "--parsable", script], capture_output=True, text=True, check=True,
                            timeout=30).stdout.strip().split(";")[0]
    state = wait_for_job(job_id)
    run_dir = tmp_path / "runs" / f"tpl-{template}"
    logs = "\n".join(p.read_text() for p in sorted((run_dir / "logs").glob("*")) if p.is_file())
    assert state == "COMPLETED", logs
    smoke = _check_smoke(run_dir)
    assert smoke["launcher"] == {"srun": "srun", "torchrun": "torchrun", "mpirun": "openmpi"}[template]


def test_a_step_with_fewer_tasks_than_the_plan_ends_with_one_message_naming_both(tmp_path: Path) -> None:
    """The geometry check: a script whose srun line was changed by hand (2 tasks, one a node, for a plan of 2 x 2)
    fails on every rank before any process group, with one line naming both sides, not a hang."""
    rendered = subprocess.run([sys.executable, "-m", "hpc_train", "render", EXAMPLE, "--site", "local-slurm",
                               *TWO_BY_TWO, "--set", "job.name=geometry", "--json"],
                              cwd=tmp_path, capture_output=True, text=True, timeout=60, check=True)
    script = Path(json.loads(rendered.stdout)["script"])
    text = script.read_text()
    assert "srun --kill-on-bad-exit=1 " in text
    script.write_text(text.replace("srun --kill-on-bad-exit=1 ", "srun --kill-on-bad-exit=1 --ntasks=2 "
                                   "--ntasks-per-node=1 ", 1))
    job_id = subprocess.run(["sbatch", "--parsable", str(script)], capture_output=True, text=True, check=True,
                            timeout=30).stdout.strip().split(";")[0]
    started = time.monotonic()
    state = wait_for_job(job_id, timeout_s=120)
    output = "\n".join(p.read_text() for p in sorted((tmp_path / "runs" / "geometry" / "logs").glob("slurm-*.*")))
    assert state == "FAILED" and time.monotonic() - started < 60, output
    said = [line for line in output.splitlines() if "the job's plan has 4" in line]
    assert said and all("srun started 2 ranks but the job's plan has 4" in line for line in said), output
    assert "Traceback" not in output


def test_sweep_is_one_job_array_with_a_run_folder_per_task(tmp_path: Path) -> None:
    """2 nodes of 1 rank per task (2 of 2: the tests above)."""
    result = _submit(tmp_path, "--site", "local-slurm", "--set", "job.nodes=2", "--set", "job.tasks_per_node=1",
                     *SMOKE, "--sweep", "train.lr=1e-3,3e-4")
    assert result.returncode == 0, result.stdout + result.stderr
    ids = _job_ids(result.stdout)
    assert len(ids) == 2 and ids[0].split("_")[0] == ids[1].split("_")[0]  # one array, two tasks
    for index, lr in enumerate(("0.001", "0.0003")):
        run_dir = tmp_path / "runs" / f"tiny-gpt-{index:03d}"
        _check_smoke(run_dir, world=2)
        assert f"lr = {lr}" in (run_dir / "config.toml").read_text()
        assert _sacct_state(ids[index]) == "COMPLETED"


def test_sweep_on_the_local_executor(tmp_path: Path) -> None:
    result = _submit(tmp_path, "--site", "local", *SMOKE, "--sweep", "train.lr=1e-3,3e-4")
    assert result.returncode == 0, result.stdout + result.stderr
    for index in range(2):
        smoke = json.loads((tmp_path / "runs" / f"tiny-gpt-{index:03d}" / "smoke.json").read_text())
        assert smoke["world_size"] == 2 and smoke["launcher"] == "submitit-local"


@pytest.mark.parametrize("site", ["local-slurm", "local"])
def test_a_rank_that_raises_ends_the_command_long_before_a_hang_would(tmp_path: Path, site: str) -> None:
    start = time.monotonic()
    result = _submit(tmp_path, "--site", site, *(TWO_BY_TWO if site == "local-slurm" else
                                                 ["--set", "job.tasks_per_node=4", *SMOKE]),
                     "--set", "env.HPC_TRAIN_INJECT_FAULT=raise:1", timeout=120)
    elapsed = time.monotonic() - start
    assert result.returncode == 1, result.stdout + result.stderr
    assert elapsed < 90, f"took {elapsed:.1f} s"  # guards a hang (minutes), not a speed: 30 s failed once under load
    out = result.stdout
    assert "failed: rank 1 on" in out
    assert "injected fault on rank 1" in out and "Traceback" in out and "state FAILED" in out
    if site == "local-slurm":
        assert _sacct_state(_job_ids(out)[0]) in ("FAILED", "CANCELLED")


def _conf_variant(tmp_path: Path, replace: dict[str, str]) -> dict[str, str]:
    text = Path("/etc/slurm/slurm.conf").read_text()
    for pattern, line in replace.items():
        text, count = re.subn(pattern, line, text, flags=re.MULTILINE)
        if not count:
            text += f"\n{line}\n"
    conf = tmp_path / "slurm.conf"
    conf.write_text(text)
    import os

    return {**os.environ, "SLURM_CONF": str(conf)}


@pytest.mark.parametrize(("case", "replace", "message"), [
    ("unreachable", {r"^SlurmctldPort=.*$": "SlurmctldPort=1"}, "the Slurm controller cannot be reached"),
    ("no-accounting", {r"^AccountingStorageType=.*$": "AccountingStorageType=accounting_storage/none"},
     "job accounting (sacct) is not available"),
])
def test_slurm_problems_exit_2_before_submitting(tmp_path: Path, case: str, replace: dict[str, str],
                                                 message: str) -> None:
    env = _conf_variant(tmp_path, replace)
    result = subprocess.run([sys.executable, "-m", "hpc_train.submit", EXAMPLE, "--site", "local-slurm",
                             "--executor", "slurm"], cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=120, check=False)
    assert result.returncode == 2, result.stdout + result.stderr
    assert message in result.stderr and result.stderr.count("error:") == 1
    assert not (tmp_path / "runs").exists()
