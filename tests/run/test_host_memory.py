"""A rank's memory cgroup: found from /proc/self/cgroup on cgroup v1 and v2, and a real out-of-memory kill. An
agent runs in a memory cgroup of its own with a 160 MiB limit, and its rank allocates 400 MiB. The kernel kills
the rank; the agent does not restart it, leaves as it died, and logs the peak the rank and the cgroup reached."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest

from hpc_train.failures.evidence import RankReport
from hpc_train.failures.signal_deaths import oom_peaks
from hpc_train.run.host_memory import memory_cgroup, memory_peak, oom_kills
from hpc_train.run.loglines import parse_host_oom
from hpc_train.run.node_log import rank_log_text

LIMIT = 160 * 2**20


def test_the_memory_cgroup_of_v1_and_v2() -> None:
    v1 = "12:pids:/user.slice\n4:memory:/slurm/uid_0/job_7/step_0\n0::/\n"
    assert memory_cgroup(v1) == (Path("/sys/fs/cgroup/memory/slurm/uid_0/job_7/step_0"), 1)
    assert memory_cgroup("1:cpu,cpuacct:/\n") is None


def test_a_process_outside_any_cgroup_counts_nothing() -> None:
    assert oom_kills((Path("/nonexistent"), 2)) == 0
    peak = memory_peak((Path("/nonexistent"), 1))
    assert peak.cgroup_bytes is None and peak.limit_bytes is None and peak.process_bytes >= 0


def _own_cgroup() -> Path:
    """A fresh memory cgroup below this process's own, with a small limit; skipped where none can be made."""
    found = memory_cgroup()
    if found is None:
        pytest.skip("this machine has no memory cgroup to place a process in")
    parent, version = found
    child = parent / f"hpc-train-test-{uuid.uuid4().hex[:8]}"
    try:
        child.mkdir()
        (child / ("memory.max" if version == 2 else "memory.limit_in_bytes")).write_text(str(LIMIT))
        if version == 2:
            (child / "memory.swap.max").write_text("0")
    except OSError as error:
        if child.exists():
            child.rmdir()
        pytest.skip(f"cannot make a memory cgroup under {parent} ({error}): needs root or a delegated cgroup")
    return child


AGENT = textwrap.dedent("""
    import os, sys
    from pathlib import Path
    with open(os.path.join(sys.argv[1], "cgroup.procs"), "w") as procs:
        procs.write(str(os.getpid()))  # the agent and everything it starts live in the small cgroup
    from hpc_train.rank.agent.agent import AgentSetup, supervise
    sys.exit(supervise(AgentSetup(Path(sys.argv[2]), 0, ("n0",), 1, "7", 0, 2, "USR2"), sys.argv[3:]))
""")
RANK = textwrap.dedent("""
    import os, sys
    with open(os.path.join(sys.argv[1], "lives.txt"), "a") as lives:
        lives.write(os.environ["HPC_TRAIN_IN_PLACE"] + "\\n")
    hoard = bytearray(400 * 2**20)  # every page written: resident, over the limit
""")


def test_an_out_of_memory_kill_is_not_restarted_and_its_peak_is_said(tmp_path: Path) -> None:
    cgroup = _own_cgroup()
    try:
        (tmp_path / "rank.py").write_text(RANK)
        env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
        agent = subprocess.run([sys.executable, "-c", AGENT, str(cgroup), str(tmp_path), sys.executable,
                                str(tmp_path / "rank.py"), str(tmp_path)], env=env, capture_output=True, text=True,
                               timeout=120, check=False)
        kills = oom_kills((cgroup, 2 if (cgroup / "memory.events").exists() else 1))
    finally:
        cgroup.rmdir()
    assert agent.returncode == -9, agent.stdout + agent.stderr  # it leaves as its rank died, for srun to say
    assert kills >= 1
    assert (tmp_path / "lives.txt").read_text().split() == ["0"]  # retry.in_place = 2 left, none used
    log = rank_log_text(tmp_path, 0)
    said = [found for line in log.splitlines() if (found := parse_host_oom(line))]
    assert len(said) == 1, log
    rank, process_gib, cgroup_gib, limit_gib = said[0]
    assert rank == 0 and limit_gib == pytest.approx(LIMIT / 2**30, abs=0.01)
    assert 0.1 < process_gib <= limit_gib + 0.01 and cgroup_gib is not None and cgroup_gib >= process_gib - 0.01
    words = oom_peaks([RankReport(0, log_tail=tuple(log.splitlines()))])
    assert words.startswith("rank 0 peaked at ") and "of 0.16 GiB" in words, words
