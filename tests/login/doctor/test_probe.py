"""The probe's batch script, its task (run here, without Slurm) and how missing reports become findings."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from hpc_train.errors import ConfigError
from hpc_train.login.doctor import probe
from hpc_train.login.doctor.probe import ProbeRequest, _Probe, _submit_env, make_probe_folder, probe_script
from tests.conftest import REPO

MARK = "t0k"  # the random token doctor writes; any text will do here
BASE = {"nodes": 2, "tasks_per_node": 1, "signal": "USR2", "run_root": "/scratch/runs",
        "python": "/opt/venv/bin/python"}


def request(**changes: Any) -> ProbeRequest:
    return ProbeRequest(**{**BASE, **changes})


def test_script_holds_only_checked_values() -> None:
    req = request(partition="batch", account="proj1", srun_args=("--mpi=pmi2",), modules=("cuda/12.4",))
    text = probe_script(req, Path("/scratch/runs/.doctor/0123abcd"))
    lines = text.splitlines()
    assert lines[0] == "#!/bin/bash -l"  # modules need a login shell
    directives = [line for line in lines if line.startswith("#SBATCH")]
    assert directives == ["#SBATCH --job-name=hpc_train-doctor", "#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=1",
                          "#SBATCH --cpus-per-task=1", "#SBATCH --time=5",
                          "#SBATCH --output=/scratch/runs/.doctor/0123abcd/probe-%j.out",
                          "#SBATCH --chdir=/scratch/runs/.doctor/0123abcd", "#SBATCH --partition=batch",
                          "#SBATCH --account=proj1"]
    assert "module load cuda/12.4" in lines
    assert lines[-1] == ("srun --kill-on-bad-exit=0 --mpi=pmi2 /opt/venv/bin/python -m "
                         "hpc_train.login.doctor.probe_task /scratch/runs/.doctor/0123abcd USR2")
    assert any(line.startswith("trap ") and line.endswith(" USR2") for line in lines)
    plain = probe_script(request(signal="sigterm"), Path("/scratch/runs/.doctor/x"))
    assert plain.startswith("#!/bin/bash\n") and plain.rstrip().endswith(" TERM")


@pytest.mark.parametrize(("changes", "where"), [
    ({"name": "probe\n#SBATCH --uid=0"}, "job.name"),
    ({"name": ""}, "job.name"),
    ({"partition": "batch\nrm -rf /"}, "job.partition"),
    ({"run_root": "/scratch/runs\n/evil"}, "job.run_root"),
    ({"run_root": "/scratch/my runs"}, "job.run_root"),
    ({"run_root": "runs"}, "job.run_root"),
    ({"python": "/opt/py; rm -rf ~"}, "software.python"),
    ({"srun_args": ("--mpi=pmi2 --uid=0",)}, "launch.srun_args"),
    ({"modules": ("cuda\nid",)}, "software.modules"),
    ({"signal": "USR1"}, "preempt.signal"),
    ({"nodes": 0}, "--nodes"),
])
def test_values_that_could_break_the_script_are_refused(changes: dict[str, Any], where: str) -> None:
    with pytest.raises(ConfigError) as error:
        probe_script(request(**changes), Path("/scratch/runs/.doctor/x"))
    assert error.value.where == where


def test_probe_folder_is_private_and_new(tmp_path: Path) -> None:
    first, second = make_probe_folder(tmp_path / "runs"), make_probe_folder(tmp_path / "runs")
    assert first != second and first.parent == second.parent == tmp_path / "runs" / ".doctor"
    for path in (first, first.parent):
        assert stat.S_IMODE(path.stat().st_mode) == 0o700


def _start_task(folder: Path, rank: str = "3", signal_name: str = "USR2", *code: str) -> subprocess.Popen[str]:
    env = {**os.environ, "SLURM_PROCID": rank, "SLURMD_NODENAME": "n7", "SLURM_JOB_ID": "42"}
    return subprocess.Popen([sys.executable, "-m", "hpc_train.login.doctor.probe_task", str(folder), signal_name,
                             *code],
                            cwd=REPO, env=env, stderr=subprocess.PIPE, text=True)


def _wait_for(path: Path, timeout: float = 20) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.02)
    return json.loads(path.read_text())


def test_task_reports_ready_then_the_signal(tmp_path: Path) -> None:
    (tmp_path / "token").write_text(MARK + "\n")
    task = _start_task(tmp_path)
    ready = _wait_for(tmp_path / "ready-3.json")
    assert ready["rank"] == 3 and ready["node"] == "n7" and ready["token"] == MARK
    assert ready["pid"] == task.pid and ready["signal"] == "USR2" and ready["job_id"] == "42"
    task.send_signal(signal.SIGUSR2)
    assert task.wait(timeout=20) == 0
    got = json.loads((tmp_path / "signal-3.json").read_text())
    assert got["signal"] == "SIGUSR2" and got["received"] >= ready["ready"]


def test_task_without_the_token_reports_none(tmp_path: Path) -> None:
    task = _start_task(tmp_path, rank="0", signal_name="SIGTERM")
    assert _wait_for(tmp_path / "ready-0.json")["token"] is None
    task.send_signal(signal.SIGTERM)
    assert task.wait(timeout=20) == 0
    assert f"cannot read {tmp_path}/token" in task.stderr.read()  # type: ignore[union-attr]


def test_task_on_a_node_without_the_folder_creates_nothing(tmp_path: Path) -> None:
    task = _start_task(tmp_path / "elsewhere", rank="0")
    assert task.wait(timeout=20) == 4
    assert "the run folder root is not shared with this node" in task.stderr.read()  # type: ignore[union-attr]
    assert not (tmp_path / "elsewhere").exists()


def test_task_usage_errors() -> None:
    from hpc_train.login.doctor.probe_task import main

    assert main([]) == 2
    assert main(["/tmp", "NOSUCHSIGNAL"]) == 2


def _ready(rank: int, node: str, seen: str | None = MARK) -> dict[str, Any]:
    return {"rank": rank, "node": node, "hostname": "host", "token": seen}


def test_a_rank_that_never_reported_names_its_node(tmp_path: Path) -> None:
    checker = _Probe(request(), tmp_path, MARK, "77", Path("/scratch/runs"))
    checker.not_ready({0: _ready(0, "n1")}, {"JobState": "RUNNING", "NodeList": "n[1-2]"}, 120)
    (finding,) = checker.findings
    assert finding.severity == "error" and finding.check == "run folder"
    assert finding.message.startswith("run folder root /scratch/runs is not shared with node n2: rank 1 never")
    assert "job.run_root" in finding.fix
    wide = _Probe(request(nodes=3, tasks_per_node=4), tmp_path, MARK, "78", Path("/scratch/runs"))
    seen = {rank: _ready(rank, "n1") for rank in range(4)} | {5: _ready(5, "n2")}
    wide.not_ready(seen, {"JobState": "RUNNING", "NodeList": "n[1-3]"}, 120)
    assert [f.message.split(" never")[0].rsplit(": ", 1)[1] for f in wide.findings] == ["ranks 4, 6, 7",
                                                                                         "ranks 8-11"]
    assert "node n2" in wide.findings[0].message and "node n3" in wide.findings[1].message


def test_a_probe_that_never_started_or_ended_early(tmp_path: Path) -> None:
    (tmp_path / "probe-77.out").write_text("python: No module named hpc_train\n")
    pending = _Probe(request(), tmp_path, MARK, "77", Path("/scratch/runs"))
    pending.not_ready({}, {"JobState": "PENDING", "Reason": "Resources"}, 30)
    assert pending.findings[0].message == "probe job 77 did not start within 30 s (PENDING, Reason=Resources)"
    assert "--probe-timeout" in pending.findings[0].fix
    failed = _Probe(request(), tmp_path, MARK, "77", Path("/scratch/runs"))
    failed.not_ready({}, {"JobState": "FAILED"}, 30)
    message = failed.findings[0].message
    assert message.startswith("probe job 77 ended (FAILED) before any rank reported: the run folder root")
    assert message.endswith("job output: python: No module named hpc_train")


def test_a_wrong_token_means_a_different_folder(tmp_path: Path) -> None:
    checker = _Probe(request(), tmp_path, MARK, "77", Path("/scratch/runs"))
    checker.tokens({0: _ready(0, "n1"), 1: _ready(1, "n2", seen="other")})
    (finding,) = checker.findings
    assert finding.severity == "error"
    assert finding.message == ("run folder root /scratch/runs is not shared with node n2: rank 1 read a different "
                               f"token in {tmp_path}")
    fine = _Probe(request(), tmp_path, MARK, "77", Path("/scratch/runs"))
    fine.tokens({0: _ready(0, "n1"), 1: _ready(1, "n2")})
    assert fine.findings[0].severity == "ok" and "on n1, n2 read doctor's token back" in fine.findings[0].message


def test_a_rank_that_never_got_the_signal(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[list[str]] = []

    def fake_slurm(argv: list[str], **_: Any) -> subprocess.CompletedProcess[str]:
        calls.append(argv)
        out = "JobId=77 JobState=RUNNING NodeList=n[1-2]\n" if argv[:3] == ["scontrol", "show", "job"] else ""
        return subprocess.CompletedProcess(argv, 0, out, "")

    monkeypatch.setattr(probe, "run_slurm", fake_slurm)
    monkeypatch.setattr(probe, "SIGNAL_WAIT_S", 0.3)
    (tmp_path / "signal-0.json").write_text(json.dumps({"rank": 0, "node": "n1", "received": time.time()}))
    checker = _Probe(request(), tmp_path, MARK, "77", Path("/scratch/runs"))
    got = checker.signal({0: _ready(0, "n1"), 1: _ready(1, "n2")})
    assert list(got) == [0] and calls[0] == ["scancel", "--signal=USR2", "77"]
    (finding,) = checker.findings
    assert finding.severity == "error" and finding.check == "probe"
    assert finding.message.startswith("rank 1 on n2 did not get SIGUSR2 within 0 s")


def test_probe_submitted_from_inside_a_job_does_not_inherit_its_geometry() -> None:
    outer = {"SLURM_JOB_ID": "9", "SLURM_NTASKS": "64", "SRUN_CPUS_PER_TASK": "8", "SLURM_CONF": "/etc/x.conf",
             "SLURM_CLUSTERS": "c2", "SBATCH_ACCOUNT": "proj", "PATH": "/usr/bin"}
    assert _submit_env(outer) == {"SLURM_CONF": "/etc/x.conf", "SLURM_CLUSTERS": "c2", "SBATCH_ACCOUNT": "proj",
                                  "PATH": "/usr/bin"}


def test_a_user_program_s_file_is_looked_for_on_every_rank(tmp_path: Path) -> None:
    (tmp_path / "token").write_text(MARK + "\n")
    (tmp_path / "loop.py").write_text("def main(ctx):\n    pass\n")
    seen = _start_task(tmp_path, "0", "USR2", str(tmp_path / "loop.py"))
    assert _wait_for(tmp_path / "ready-0.json")["code_seen"] is True
    blind = _start_task(tmp_path, "1", "USR2", str(tmp_path / "elsewhere" / "loop.py"))
    assert _wait_for(tmp_path / "ready-1.json")["code_seen"] is False
    for task in (seen, blind):
        task.send_signal(signal.SIGUSR2)
        assert task.wait(timeout=20) == 0
    script = probe_script(request(code_path="/scratch/code/loop.py"), tmp_path)
    assert script.splitlines()[-1].endswith(f"probe_task {tmp_path} USR2 /scratch/code/loop.py")
    checker = _Probe(request(code_path="/scratch/code/loop.py"), tmp_path, MARK, "77", Path("/scratch/runs"))
    checker.code({0: {**_ready(0, "n1"), "code_seen": True}, 1: {**_ready(1, "n2"), "code_seen": False}})
    (finding,) = checker.findings
    assert (finding.check, finding.severity) == ("code folder", "error")
    assert finding.message == "the program /scratch/code/loop.py is not visible on n2"
    with pytest.raises(ConfigError, match=r"^job\.program: its path"):
        request(code_path="/scratch/code/loop.py\nrm -rf ~").validate()
