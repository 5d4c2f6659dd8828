"""Parsing scontrol / sinfo output and the partition rules, on fixture strings: no cluster needed."""

from __future__ import annotations

from pathlib import Path

import pytest

from hpc_train.config.loader import build
from hpc_train.config.site import SiteConfig
from hpc_train.login.doctor.findings import Finding, exit_status, summary
from hpc_train.login.doctor.slurm_checks import (
    ClusterView,
    JobShape,
    check_partition,
    check_reachable,
    check_site,
    choose_partition,
    parse_gpus,
    parse_nodes,
    parse_oneliner,
    parse_partitions,
    parse_slurm_time,
    run_slurm,
)

# As Slurm 22.05 prints them (batch and urgent from the local cluster), plus a GPU partition and a down one.
FIXTURES = Path(__file__).parent / "fixtures"
PARTITIONS = (FIXTURES / "scontrol_partitions.txt").read_text()
NODES = (FIXTURES / "sinfo_nodes.txt").read_text()


@pytest.fixture
def view() -> ClusterView:
    return ClusterView(parse_partitions(PARTITIONS), tuple(parse_nodes(NODES)))


def only(findings: list[Finding], severity: str) -> list[Finding]:
    return [f for f in findings if f.severity == severity]


def test_oneliner_values_may_hold_spaces_and_equals_signs() -> None:
    fields = parse_oneliner("NodeName=n1 OS=Linux 6.1.0 #1 SMP PREEMPT_DYNAMIC CfgTRES=cpu=4,mem=4000M Gres=(null)")
    assert fields["OS"] == "Linux 6.1.0 #1 SMP PREEMPT_DYNAMIC"
    assert fields["CfgTRES"] == "cpu=4,mem=4000M"
    assert fields["Gres"] == "(null)"
    assert parse_oneliner("") == {}


def test_partitions_are_parsed(view: ClusterView) -> None:
    batch, gpu, old = view.partitions["batch"], view.partitions["gpu"], view.partitions["old"]
    assert batch.default and batch.state == "UP" and batch.max_time_s is None and batch.max_nodes is None
    assert batch.total_nodes == 2 and batch.nodes == "n[1-2]" and batch.max_cpus_per_node is None
    assert not gpu.default and gpu.max_time_s == 86400 and gpu.max_nodes == 4 and gpu.max_cpus_per_node == 96
    assert old.state == "DOWN" and old.max_time_s == 1800 and old.nodes == "" and old.total_nodes == 0
    assert parse_partitions("No partitions in the system\n") == {}


@pytest.mark.parametrize(("text", "seconds"), [
    ("UNLIMITED", None), ("INFINITE", None), ("NONE", None), ("1-00:00:00", 86400), ("2:00:00", 7200),
    ("30:00", 1800), ("5", 300), ("nonsense", None),
])
def test_slurm_times(text: str, seconds: int | None) -> None:
    assert parse_slurm_time(text) == seconds


@pytest.mark.parametrize(("gres", "gpus"), [
    ("(null)", 0), ("", 0), ("gpu:8", 8), ("gpu:h100:8(S:0-1)", 8), ("gpu:a100:2(S:0),gpu:a100:2(S:1)", 4),
    ("gpu:h100:4(IDX:0,2,4,6),nvme:1", 4), ("nvme:1", 0), ("gpu", 1),
])
def test_gpus_from_gres(gres: str, gpus: int) -> None:
    assert parse_gpus(gres) == gpus


def test_nodes_are_parsed(view: ClusterView) -> None:
    batch = view.members("batch")
    assert [(n.name, n.cpus, n.gpus) for n in batch] == [("n1", 4, 0), ("n2", 4, 0)]  # "batch*" is the default
    usable = {n.name: n.usable for n in view.members("gpu")}
    assert usable == {"g01": True, "g02": True, "g03": False, "g04": False}
    assert parse_nodes("garbage\n|||\n") == []


def test_a_job_that_fits(view: ClusterView) -> None:
    findings = check_partition(JobShape("batch", nodes=2, tasks_per_node=2, cpus_per_task=2, time="04:00:00"), view)
    assert [f.severity for f in findings] == ["ok"]
    assert 'partition "batch" is UP' in findings[0].message and "2 nodes x 2 tasks x 2 CPUs" in findings[0].message


def test_empty_partition_means_the_default(view: ClusterView) -> None:
    shape = JobShape("", nodes=1, tasks_per_node=1)
    assert choose_partition(shape, view.partitions).name == "batch"  # type: ignore[union-attr]
    no_default = {name: p for name, p in view.partitions.items() if not p.default}
    found = choose_partition(shape, no_default)
    assert isinstance(found, Finding) and found.severity == "error"
    assert "no default partition" in found.message and "gpu, old, urgent" in found.fix


def test_unknown_partition_suggests_the_closest(view: ClusterView) -> None:
    (finding,) = check_partition(JobShape("bach", nodes=1, tasks_per_node=1), view)
    assert finding.severity == "error" and finding.check == "partition"
    assert finding.message == 'partition "bach" does not exist, did you mean "batch"?'
    assert finding.fix == "set job.partition to one of: batch, gpu, old, urgent"


def test_time_over_the_partition_limit(view: ClusterView) -> None:
    shape = JobShape("gpu", nodes=1, tasks_per_node=8, cpus_per_task=8, gpus_per_node=8, time="2-00:00:00")
    (finding,) = only(check_partition(shape, view), "error")
    assert finding.message == 'job.time = 2-00:00:00 is longer than the MaxTime 1-00:00:00 of partition "gpu"'
    assert finding.fix == "set job.time <= 1-00:00:00, or choose another partition"


def test_more_nodes_than_the_partition_has(view: ClusterView) -> None:
    (finding,) = check_partition(JobShape("batch", nodes=3, tasks_per_node=1), view)
    assert finding.severity == "error"
    assert finding.message == 'job.nodes = 3, but partition "batch" has 2 nodes'
    assert finding.fix == "set job.nodes <= 2, or choose another partition"
    (max_nodes,) = check_partition(JobShape("gpu", nodes=5, tasks_per_node=1), view)
    assert "at most 4 nodes per job (MaxNodes)" in max_nodes.message


def test_cpus_and_gpus_per_node(view: ClusterView) -> None:
    (cpus,) = check_partition(JobShape("batch", nodes=1, tasks_per_node=4, cpus_per_task=2), view)
    assert cpus.severity == "error" and "= 8 CPUs per node" in cpus.message and "at most 4" in cpus.message
    assert cpus.fix.startswith("lower job.tasks_per_node x job.cpus_per_task to <= 4")
    (capped,) = check_partition(JobShape("gpu", nodes=1, tasks_per_node=8, cpus_per_task=14, gpus_per_node=8), view)
    assert "at most 96" in capped.message  # MaxCPUsPerNode, not the 112 the nodes have
    (gpus,) = check_partition(JobShape("gpu", nodes=1, tasks_per_node=8, gpus_per_node=16), view)
    assert "job.gpus_per_node = 16" in gpus.message and "at most 8 GPUs (gres)" in gpus.message
    (none,) = check_partition(JobShape("batch", nodes=1, tasks_per_node=1, gpus_per_node=1), view)
    assert "no GPUs (gres gpu)" in none.message and "choose a GPU partition (job.partition)" in none.fix


def test_nodes_that_are_down_make_the_job_wait(view: ClusterView) -> None:
    findings = check_partition(JobShape("gpu", nodes=3, tasks_per_node=8, gpus_per_node=8), view)
    (warning,) = findings
    assert warning.severity == "warning"
    assert "only 2 of the 4 nodes" in warning.message and "(g03 drained, g04 down*)" in warning.message
    assert exit_status(findings) == 0


def test_a_down_partition(view: ClusterView) -> None:
    findings = check_partition(JobShape("old", nodes=1, tasks_per_node=1, time="10:00"), view)
    assert findings[0].message == 'partition "old" is DOWN: no job starts there'
    assert exit_status(findings) == 1


def test_without_a_config_the_fixes_name_doctor_flags(view: ClusterView) -> None:
    (finding,) = check_partition(JobShape("batch", nodes=3, tasks_per_node=1, from_config=False), view)
    assert finding.fix == "set --nodes <= 2, or choose another partition"


def test_site_file_against_the_partition(view: ClusterView) -> None:
    site = build(SiteConfig, {"name": "big", "slurm": {"max_time": "2-00:00:00"}, "node": {"cpus": 128, "gpus": 8}},
                 prefix="")
    gpu = view.partitions["gpu"]
    messages = [f.message for f in check_site(site, gpu, view.members("gpu"))]
    assert len(messages) == 2
    assert "slurm.max_time = 2-00:00:00" in messages[0] and "allows 1-00:00:00" in messages[0]
    assert "node.cpus = 128" in messages[1] and "at most 112" in messages[1]
    fitting = build(SiteConfig, {"name": "ok", "slurm": {"max_time": "1-00:00:00"}, "node": {"cpus": 112, "gpus": 8}},
                    prefix="")
    assert check_site(fitting, gpu, view.members("gpu")) == []


def test_missing_and_hanging_commands_become_results() -> None:
    assert run_slurm(["/nonexistent/sinfo"]).returncode == 127
    slow = run_slurm(["sleep", "5"], timeout=0.1)
    assert slow.returncode == 124 and "did not answer within" in slow.stderr


def test_slurm_not_on_path(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    (finding,) = check_reachable()
    assert finding.severity == "error" and "sinfo, scontrol, sbatch, scancel not found on PATH" in finding.message


def test_summary_and_exit_status() -> None:
    findings = [Finding("a", "ok", "x"), Finding("b", "warning", "y", "z"), Finding("c", "warning", "y", "z")]
    assert summary(findings) == "2 warnings, 1 ok" and exit_status(findings) == 0
    findings.append(Finding("d", "error", "bad", "fix it"))
    assert summary(findings) == "1 error, 2 warnings, 1 ok" and exit_status(findings) == 1
    with pytest.raises(ValueError, match="unknown severity"):
        Finding("e", "fatal", "no")  # type: ignore[arg-type]
