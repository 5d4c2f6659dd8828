"""The scale lane (scripts/scale_lane.sh, not the 30-minute CI): 64 nodes and a hot spare of the local Slurm
cluster (65 slurmd on this machine), one task each, through the real sbatch script, srun, agents and coordinator,
with a lightweight rank (light_rank.py) in place of training. It starts, a killed rank restarts every rank in
place, a lost node's ranks go to the spare, and the run folder holds O(nodes) files.

Run it with ``scripts/scale_lane.sh``, which grows the cluster to 65 nodes, runs this file and shrinks it back.
Elsewhere (the usual 3-node cluster) it skips, saying so.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hpc_train.control.client import ControlClient
from hpc_train.run.procs import environment, processes
from tests.conftest import REPO

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("slurm_cluster")]

NODES = 64
HERE = Path(__file__).resolve().parent


def _spares_partition_size() -> int:
    out = subprocess.run(["sinfo", "-h", "-p", "spares", "-o", "%D"], capture_output=True, text=True, timeout=30,
                         check=False).stdout.split()
    return int(out[0]) if out and out[0].isdigit() else 0


def _lane_script(tmp_path: Path) -> tuple[Path, Path]:
    """The job's own rendered srun script, its agent started over the lightweight rank."""
    rendered = subprocess.run(
        [sys.executable, "-m", "hpc_train", "render", str(REPO / "examples" / "tiny_gpt.toml"), "--site",
         "local-slurm", "--set", f"job.nodes={NODES}", "--set", "job.tasks_per_node=1", "--set", "job.spare_nodes=1",
         "--set", "job.partition=spares", "--set", "job.cpus_per_task=1", "--set", "retry.in_place=3", "--template",
         "srun", "--json"], cwd=tmp_path, capture_output=True, text=True, timeout=120, check=True)
    paths = json.loads(rendered.stdout)
    script, run_dir = Path(paths["script"]), Path(paths["run_dir"])
    text = script.read_text()
    agent = f"-m hpc_train.agent {run_dir} || status=$?"
    if agent not in text:
        raise AssertionError(f"the rendered script has no agent line: {text[-500:]}")
    lane = script.with_name("lane.sbatch")
    lane.write_text(text.replace(agent, f"{HERE / 'lane_agent.py'} {run_dir} || status=$?"))
    return lane, run_dir


def _watch(run_dir: Path, job_id: str, timeout_s: float = 120) -> ControlClient:
    address = run_dir / "heartbeats" / f"control-{job_id}.0.json"
    deadline = time.monotonic() + timeout_s
    while not address.exists():
        assert time.monotonic() < deadline, f"no coordinator within {timeout_s:.0f} s"
        time.sleep(0.5)
    found = json.loads(address.read_text())
    client = ControlClient.connect(found["host"], found["port"], found["token"], "scale-lane")
    client.watch("")
    return client


def _running(client: ControlClient, life: int, timeout_s: float = 300) -> dict[int, dict[str, object]]:
    """Every rank of life ``life`` once all NODES say they run."""
    prefix = f"lane/running/{life}/"
    deadline = time.monotonic() + timeout_s
    while True:
        ranks = {int(k.rpartition("/")[2]): v for k, v in list(client.known.items()) if k.startswith(prefix)}
        if len(ranks) == NODES:
            return ranks
        assert time.monotonic() < deadline, f"life {life}: {len(ranks)} of {NODES} ranks running"
        time.sleep(0.2)


def _kill_node(job_id: str, node: str) -> int:
    killed = 0
    for process in processes():
        env = environment(process.pid) or {}
        if env.get(b"SLURM_JOB_ID") == job_id.encode() and env.get(b"SLURMD_NODENAME") == node.encode():
            with contextlib.suppress(ProcessLookupError):
                os.kill(process.pid, signal.SIGKILL)
                killed += 1
    return killed


def test_64_nodes_start_restart_in_place_and_a_spare_takes_a_lost_node(tmp_path: Path) -> None:
    if _spares_partition_size() < NODES + 1:
        pytest.skip(f"the scale lane needs {NODES + 1} nodes in the local cluster: scripts/scale_lane.sh")
    script, run_dir = _lane_script(tmp_path)
    submitted = time.monotonic()
    job_id = subprocess.run(["sbatch", "--parsable", str(script)], capture_output=True, text=True, check=True,
                            timeout=60).stdout.strip().split(";")[0]
    try:
        client = _watch(run_dir, job_id)
        first = _running(client, 0)
        started = time.monotonic() - submitted
        attempt = f"{job_id}.0"

        victim = first[5]  # a rank killed: every rank starts again in place, on the same nodes
        os.kill(int(victim["pid"]), signal.SIGKILL)
        notice = client.wait_for(f"{attempt}/restart/1", 60)
        decided = client.wait_for(f"{attempt}/ready/1", 120)
        again = _running(client, 1)
        assert notice is not None and notice["failure_class"] == "killed", notice
        assert decided is not None and decided["gone"] == [], decided
        restart_s = max(float(v["time"]) for v in again.values()) - float(notice["time"])

        lost = str(again[7]["node"])  # a node lost: the spare takes its rank
        assert _kill_node(job_id, lost) >= 2  # its agent and its rank
        notice = client.wait_for(f"{attempt}/restart/2", 60)
        decided = client.wait_for(f"{attempt}/ready/2", 120)
        third = _running(client, 2)
        assert notice is not None and "vanished" in notice["reason"], notice
        assert decided is not None and decided["gone"] == [f"node-7@{lost}"], decided
        assert str(third[7]["node"]) == f"n{NODES + 1}" and lost not in {str(v["node"]) for v in third.values()}
        spare_s = max(float(v["time"]) for v in third.values()) - float(notice["time"])
        client.set("lane/finish", True)
        client.close()
    finally:
        subprocess.run(["scancel", job_id], check=False, timeout=60)
    files = sum(len(names) for _, _, names in os.walk(run_dir))
    print(f"scale lane: {NODES} nodes + 1 spare: all ranks running {started:.1f} s after sbatch; a killed rank to "
          f"every rank running again {restart_s:.2f} s; a lost node to its rank running on the spare {spare_s:.2f} s;"
          f" {files} files in the run folder")
    assert files <= 4 * (NODES + 1) + 40, f"{files} files in the run folder for {NODES + 1} nodes"
