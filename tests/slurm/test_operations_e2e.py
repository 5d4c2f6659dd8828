"""Operations on the real local Slurm cluster: a rank that hangs (found by the watchdog within its timeout,
stacks dumped, restarted inside the job, then requeued, resumed to the end) and a node that goes down mid-run
(requeued on the other node with the failed one excluded, resumed from its checkpoint)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hpc_train.run.node_log import rank_log_text
from hpc_train.run.watch import last_logged_step
from tests.slurm.test_preemption_e2e import (
    BASE,
    EXAMPLE,
    NO_STANDBY,
    ONE_NODE,
    TINY,
    _attempts,
    _logs,
    _state,
    _submit,
    _wait_until_completed,
)

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("slurm_cluster")]


def test_a_hung_rank_is_restarted_in_place_then_requeued_once_retry_in_place_is_spent(tmp_path: Path) -> None:
    """Rank 1 hangs at step 15 in every life of the job's first Slurm attempt: the watchdog finds it, the ranks
    start again inside the job (retry.in_place = 1), it hangs again, and with no restart in place left the job
    is requeued as before; the requeued attempt runs to the end. Rank 0, which waited on rank 1 in a collective,
    trains the restart in place in its own process (warm). The restart in place resumes from the copy of
    step 10 in the nodes' memory (``checkpoint.memory_every_steps = 5``); the requeued attempt's new agents hold no
    memory, and it resumes from the disk."""
    timeout_s = 10  # watchdog.step_timeout_s: its lowest valid value
    job_id = _submit(tmp_path, 30, "--set", "env.HPC_TRAIN_INJECT_FAULT=hang:1", "--set",
                     "env.HPC_TRAIN_INJECT_FAULT_STEP=15", "--set", "env.HPC_TRAIN_INJECT_FAULT_RESTART=0",
                     "--set", f"watchdog.step_timeout_s={timeout_s}", "--set", "retry.hang=1",
                     "--set", "retry.in_place=1", "--set", "checkpoint.memory_every_steps=5")
    run_dir = tmp_path / "runs" / "tiny-gpt"
    _wait_until_completed(job_id, run_dir, timeout_s=480)
    first, second, third = _attempts(run_dir)
    assert first["outcome"] == "hang" and not first["requeued"] and first["in_place"] == 0, first
    assert "restarting in place (1 of 1, retry.in_place)" in str(first["note"]), first
    assert second["in_place"] == 1 and second["restart"] == 0 and second["start_step"] == 10, second
    assert second["outcome"] == "hang" and second["requeued"], second
    for hung in (first, second):
        assert hung["end_step"] == 14, hung  # the last step that finished before rank 1 stopped
        waited = float(str(hung["note"]).split("no progress for ")[1].split(" s")[0])
        assert timeout_s <= waited <= timeout_s + 5, hung["note"]
        assert "rank 1 in" in str(hung["note"]) and "maybe_inject_fault" in str(hung["note"])
    for rank in (0, 1):
        assert "# main thread 0x" in (run_dir / "logs" / f"stacks-rank-{rank}.txt").read_text()
    assert third["outcome"] == "completed" and third["restart"] == 1 and third["start_step"] == 10, third
    assert last_logged_step(run_dir) == 30
    rank0 = rank_log_text(run_dir, 0)
    assert rank0.count("resumed from memory at step 10") == 1, _logs(run_dir)  # the second life; not the requeue
    # rank 0 was waiting on rank 1 in a collective: once rank 1 left, it trained the second life in its own process
    assert "hang: rank(s) 1 leave; this rank restarts warm once its collective fails" in rank0, rank0[-3000:]
    assert rank0.count("restarting warm: this process trains the next life") == 1, rank0[-3000:]
    assert "1 rank(s) of this node restarted warm, in their own process" in rank0, rank0[-3000:]


def _resume_if_down(node: str) -> None:
    state = subprocess.run(["sinfo", "-h", "-N", "-n", node, "-o", "%T"], capture_output=True, text=True,
                           timeout=30, check=False).stdout
    if any(word in state.upper() for word in ("DOWN", "DRAIN", "FAIL")):
        subprocess.run(["scontrol", "update", f"nodename={node}", "state=resume"], check=False, timeout=30)


def _node_of(job_id: str) -> str:
    out = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%N"], capture_output=True, text=True, timeout=30,
                         check=False).stdout.strip()
    return out


def test_a_node_that_goes_down_is_excluded_and_the_run_resumes(tmp_path: Path) -> None:
    job_id = _submit(tmp_path, 40, "--set", "job.nodes=1", "--set", "job.tasks_per_node=2", *NO_STANDBY)
    run_dir = tmp_path / "runs" / "tiny-gpt"
    deadline = time.monotonic() + 240
    while last_logged_step(run_dir) < 13:
        assert time.monotonic() < deadline, _logs(run_dir)
        time.sleep(0.5)
    node = _node_of(job_id)
    assert node in ("n1", "n2"), node
    try:
        subprocess.run(["scontrol", "update", f"nodename={node}", "state=down", "reason=hpc_train test"],
                       check=True, timeout=30)
        # NODE_FAIL is a passing state here: Slurm requeues the job by itself.
        _wait_until_completed(job_id, run_dir, timeout_s=300, bad_states={"FAILED", "CANCELLED", "TIMEOUT"})
    finally:
        _resume_if_down(node)
    attempts = _attempts(run_dir)
    assert attempts[0]["outcome"] == "node_failure" and node in str(attempts[0]["note"]), attempts
    excluded = json.loads((run_dir / "excluded_nodes.json").read_text())
    assert [entry["node"] for entry in excluded["nodes"]] == [node], excluded
    # The slurmd of a node set DOWN here still delivers SIGTERM, so the ranks saved; a dead node saves nothing
    # and the run resumes from its last periodic checkpoint instead.
    assert attempts[-1]["outcome"] == "completed", attempts
    assert attempts[-1]["start_step"] == attempts[0]["end_step"] >= 13, attempts
    rows = subprocess.run(["sacct", "-n", "-P", "-X", "-D", "-j", job_id, "-o", "State,NodeList"],
                          capture_output=True, text=True, timeout=30, check=True).stdout.split()
    assert rows[-1] == f"COMPLETED|{'n2' if node == 'n1' else 'n1'}", rows  # the last attempt avoided the node
    if len(rows) > 2:  # Slurm put the requeued job on the excluded node again: it moved itself with ExcNodeList
        show = subprocess.run(["scontrol", "show", "job", job_id], capture_output=True, text=True, timeout=30).stdout
        assert f"ExcNodeList={node}" in show, show


def _ended_with_fault(tmp_path: Path, fault: str, *extra: str) -> tuple[str, Path]:
    """A 30-step job whose fault fires at step 5, waited for until Slurm ends it: (job id, run folder)."""
    job_id = _submit(tmp_path, 30, "--set", f"env.HPC_TRAIN_INJECT_FAULT={fault}", "--set",
                     "env.HPC_TRAIN_INJECT_FAULT_STEP=5", *extra)
    run_dir = tmp_path / "runs" / "tiny-gpt"
    deadline = time.monotonic() + 180
    while _state(job_id) not in ("FAILED", "CANCELLED", "COMPLETED"):
        assert time.monotonic() < deadline, _logs(run_dir)
        time.sleep(1)
    return job_id, run_dir


def test_a_rank_that_raises_is_a_user_error_and_not_retried(tmp_path: Path) -> None:
    """Followed as users run it, on one node of two ranks: rank 1 raises, its record goes into its node's
    ``errors-0-1.jsonl``, the node's agent ends rank 0 and leaves, and the follower names rank 1's error."""
    followed = subprocess.run([sys.executable, "-m", "hpc_train.submit", EXAMPLE, *TINY, *ONE_NODE, "--set",
                               "train.steps=30", "--set", "env.HPC_TRAIN_INJECT_FAULT=raise:1", "--set",
                               "env.HPC_TRAIN_INJECT_FAULT_STEP=5"], cwd=tmp_path, capture_output=True, text=True,
                              timeout=300, check=False)
    out = followed.stdout
    assert followed.returncode == 1 and "failed: rank 1 on" in out and "injected fault on rank 1" in out, \
        out[-3000:] + followed.stderr[-3000:]
    (job_id,) = re.findall(r"submitted job (\d+)", out)
    run_dir = tmp_path / "runs" / "tiny-gpt"
    assert (run_dir / "logs" / "errors-0-1.jsonl").exists() and not (run_dir / "logs" / "rank-1.error.json").exists()
    time.sleep(3)  # a requeue, if there were one, would show by now
    rows = subprocess.run(["sacct", "-n", "-P", "-X", "-D", "-j", job_id, "-o", "State"], capture_output=True,
                          text=True, timeout=30, check=True).stdout.split()
    assert rows == ["FAILED"], rows  # one attempt: never requeued
    assert not (run_dir / "excluded_nodes.json").exists()
    status = subprocess.run([sys.executable, "-m", "hpc_train", "status", str(run_dir), "--json"],
                            capture_output=True, text=True, timeout=60, check=False)
    assert status.returncode == 0, status.stderr
    text = status.stdout
    assert "user_error" in text and "injected fault on rank 1" in text, text
    logs = subprocess.run([sys.executable, "-m", "hpc_train", "logs", str(run_dir), "--errors-only"],
                          capture_output=True, text=True, timeout=60, check=False)
    assert logs.returncode == 0 and "RuntimeError: injected fault on rank 1" in logs.stdout, logs.stdout


@pytest.mark.parametrize(("number", "kind", "name"), [(9, "killed", "SIGKILL"), (11, "crashed", "SIGSEGV")])
def test_a_rank_that_dies_on_a_signal_is_named_with_its_class(tmp_path: Path, number: int, kind: str,
                                                               name: str) -> None:
    """Rank 1 ends on ``kill -9`` (or a segfault) at step 5, no traceback, with restarts in place off (or spent):
    status says killed (crashed), names rank 1, its node and the signal, and the run is not requeued."""
    _job, run_dir = _ended_with_fault(tmp_path, f"signal:1:{number}", "--set", "retry.in_place=0")
    status = subprocess.run([sys.executable, "-m", "hpc_train", "status", str(run_dir), "--json"],
                            capture_output=True, text=True, timeout=60, check=False)
    assert status.returncode == 0, status.stderr
    failures = _failures(json.loads(status.stdout))
    assert failures and failures[-1]["class"] == kind, status.stdout
    reason = failures[-1]["reason"]
    # Under load srun can be force-terminated before it writes rank 1's line: then the classifier still names
    # rank 1 (the rank that left nothing while rank 0 lost its peer) but cannot know its signal, and says so.
    assert "rank 1" in reason and (name in reason or "a signal srun did not name" in reason), failures[-1]
    assert not (run_dir / "excluded_nodes.json").exists()


def _failures(data: object) -> list[dict]:
    """Every object with a failure ``class`` inside ``status --json``'s output."""
    found: list[dict] = []
    if isinstance(data, dict):
        if isinstance(data.get("class"), str) and "reason" in data:
            found.append(data)
        for value in data.values():
            found += _failures(value)
    elif isinstance(data, list):
        for value in data:
            found += _failures(value)
    return found


def test_a_second_submission_to_a_busy_run_folder_is_refused(tmp_path: Path) -> None:
    job_id = _submit(tmp_path, 400, *NO_STANDBY)
    try:
        again = subprocess.run([sys.executable, "-m", "hpc_train.submit", EXAMPLE, *BASE, "--set", "train.steps=400",
                                "--no-follow"], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                               check=False)
        assert again.returncode == 2, again.stdout[-2000:] + again.stderr[-2000:]
        assert f"is in use by job {job_id}" in again.stderr and f"scancel {job_id}" in again.stderr, again.stderr
        assert "submitted job" not in again.stdout
    finally:
        subprocess.run(["scancel", job_id], check=False, timeout=30)
