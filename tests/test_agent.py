"""The agent that restarts ranks inside the job (hpc_train.agent), with real processes as its ranks: a rank that
dies of SIGKILL makes every agent end its rank (and what the rank started) and start it again; a program's own
error, or a kill once ``retry.in_place`` is spent, leaves as the rank did."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from hpc_train.agent import agent_setup
from hpc_train.run.attempts import AttemptLog
from hpc_train.run.in_place import read_notice
from hpc_train.run.node_log import rank_log_text

AGENT = """
import sys
from pathlib import Path
from hpc_train.agent import AgentSetup, supervise
run_dir, rank, world, limit = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
sys.exit(supervise(AgentSetup(run_dir, rank, world, "7", 0, limit, "USR2"), sys.argv[5:]))
"""

RANK = textwrap.dedent("""
    import os, signal, subprocess, sys, time
    run_dir, rank, mode = sys.argv[1], sys.argv[2], sys.argv[3]
    life = os.environ["HPC_TRAIN_IN_PLACE"]
    with open(os.path.join(run_dir, "lives.txt"), "a") as lives:
        lives.write(f"{rank} {life} {os.environ['HPC_TRAIN_IN_PLACE_LEFT']}\\n")
    if mode == "user-error":
        sys.exit(1)
    if mode == "handover":  # failed, and its recovery made the next job of a chain ([slurm] requeue = "dependency")
        from hpc_train.run.chain import record_successor
        from hpc_train.run.exit_codes import EXIT_RESTART_IN_PLACE
        record_successor(run_dir, "7", "8")
        sys.exit(EXIT_RESTART_IN_PLACE)
    if mode == "kill-agent":  # its node is lost: the agent vanishes without a word (and the rank with it)
        time.sleep(0.5)
        os.kill(os.getppid(), signal.SIGKILL)
        sys.exit(0)
    if mode == "always-kill" or (mode == "kill-first" and life == "0"):
        time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGKILL)
    if mode == "wait-first" and life == "0":
        worker = subprocess.Popen(["sleep", "300"])  # a data loader worker, say
        with open(os.path.join(run_dir, "worker.pid"), "w") as out:
            out.write(str(worker.pid))
        while True:
            time.sleep(1)  # blocked in a collective with the dead peer
""")


def _agents(tmp_path: Path, modes: list[str], limit: int = 2) -> list[subprocess.CompletedProcess[str]]:
    rank_script = tmp_path / "rank.py"
    rank_script.write_text(RANK)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    env.pop("HPC_TRAIN_IN_PLACE_LEFT", None)
    procs = [subprocess.Popen([sys.executable, "-c", AGENT, str(tmp_path), str(rank), str(len(modes)), str(limit),
                               sys.executable, str(rank_script), str(tmp_path), str(rank), mode],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for rank, mode in enumerate(modes)]
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        results.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
    return results


def _lives(tmp_path: Path) -> list[str]:
    return sorted((tmp_path / "lives.txt").read_text().splitlines())


def test_a_killed_rank_restarts_every_rank_and_nothing_of_the_old_life_is_left(tmp_path: Path) -> None:
    AttemptLog(tmp_path).begin(job_id="7", restart=0, host="n1", started=1.0, start_step=0)
    rank0, rank1 = _agents(tmp_path, ["wait-first", "kill-first"])
    assert rank0.returncode == 0 and rank1.returncode == 0, rank0.stderr + rank1.stderr
    assert _lives(tmp_path) == ["0 0 2", "0 1 1", "1 0 2", "1 1 1"]  # both ranks lived twice
    worker = int((tmp_path / "worker.pid").read_text())
    assert not Path(f"/proc/{worker}").exists() or "Z" in Path(f"/proc/{worker}/stat").read_text().split(")")[1][:3]
    notice = read_notice(tmp_path, "7.0", 1)
    assert notice is not None and notice.rank == 1 and notice.failure_class == "killed", notice
    assert "SIGKILL" in notice.reason
    (first,) = AttemptLog(tmp_path).read()
    assert first.outcome == "killed" and "restarted in place (1 of retry.in_place = 2)" in first.note, first
    log = rank_log_text(tmp_path, 0)
    assert "in-place restart 1 of 2 (retry.in_place): killed" in log, log
    # rank 0's agent hosted the coordinator: the barrier went over the network, not through per-rank markers
    address = tmp_path / "heartbeats" / "control-7.0.json"
    assert address.stat().st_mode & 0o777 == 0o600, oct(address.stat().st_mode)
    assert not list((tmp_path / "heartbeats").glob("restart-7.0.1.ready-*"))
    assert "coordinate through the run folder" not in log + rank_log_text(tmp_path, 1)


def test_once_retry_in_place_is_spent_the_agent_dies_as_its_rank_did(tmp_path: Path) -> None:
    (only,) = _agents(tmp_path, ["always-kill"], limit=2)
    assert only.returncode == -9, only.stderr  # srun reports "Killed", as without the agent
    assert _lives(tmp_path) == ["0 0 2", "0 1 1", "0 2 0"]
    log = rank_log_text(tmp_path, 0)
    assert "no in-place restart left (retry.in_place = 2)" in log, log


def test_the_programs_own_error_is_not_restarted(tmp_path: Path) -> None:
    (only,) = _agents(tmp_path, ["user-error"])
    assert only.returncode == 1, only.stderr
    assert _lives(tmp_path) == ["0 0 2"]
    assert read_notice(tmp_path, "7.0", 1) is None


def test_a_job_that_handed_the_run_to_the_next_job_of_its_chain_is_not_restarted_in_place(tmp_path: Path) -> None:
    """Where requeue is forbidden the next attempt is a new job: once this job has made it, a restart in place
    would train beside it, so the agent leaves with its rank's status."""
    from hpc_train.run.exit_codes import EXIT_RESTART_IN_PLACE

    (only,) = _agents(tmp_path, ["handover"])
    assert only.returncode == EXIT_RESTART_IN_PLACE, only.stderr
    assert _lives(tmp_path) == ["0 0 2"]
    assert read_notice(tmp_path, "7.0", 1) is None
    log = rank_log_text(tmp_path, 0)
    assert 'job 7 handed the run to job 8 ([slurm] requeue = "dependency"): no restart in place' in log, log


def test_once_the_run_goes_on_as_the_next_job_the_other_ranks_are_ended_not_left_waiting(tmp_path: Path) -> None:
    """Rank 0 hands the run to the next job (as its look-back does on an excluded node) and leaves; rank 1 is
    blocked waiting for it (its rendezvous would time out only after dist.init_timeout_s). Its agent ends it, and
    what it started, soon after, as ``scontrol requeue`` would, and restarts nothing."""
    from hpc_train.run.exit_codes import EXIT_RESTART_IN_PLACE

    start = time.monotonic()
    rank0, rank1 = _agents(tmp_path, ["handover", "wait-first"])
    assert time.monotonic() - start < 60, "rank 1 was left waiting"
    assert rank0.returncode == EXIT_RESTART_IN_PLACE and rank1.returncode == -9, rank0.stderr + rank1.stderr
    assert _lives(tmp_path) == ["0 0 2", "1 0 2"]
    worker = int((tmp_path / "worker.pid").read_text())
    assert not Path(f"/proc/{worker}").exists() or "Z" in Path(f"/proc/{worker}/stat").read_text().split(")")[1][:3]
    log = rank_log_text(tmp_path, 1)
    assert "ending rank 1: this job's run goes on as job 8" in log, log


def _planned(tmp_path: Path, *overrides: str) -> Path:
    """A run folder with the plan.json of the tiny GPT on two nodes of the local Slurm site."""
    from hpc_train.config.plan import load_job, make_plan
    from hpc_train.config.sites import load_site
    from tests.conftest import REPO

    cfg = load_job(REPO / "examples" / "tiny_gpt.toml", ["job.nodes=2", "job.tasks_per_node=1", *overrides])
    plan = make_plan(cfg, load_site("local-slurm"), "slurm", cwd=tmp_path)
    run_dir = Path(plan.run_dir)
    run_dir.mkdir(parents=True, mode=0o700)
    (run_dir / "plan.json").write_text(plan.to_json())
    return run_dir


def test_an_srun_task_of_a_training_job_gets_an_agent_with_the_plans_limit(tmp_path: Path) -> None:
    run_dir = _planned(tmp_path)
    step = {"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0", "SLURM_PROCID": "1", "SLURM_STEP_NUM_TASKS": "2",
            "SLURM_RESTART_COUNT": "1"}
    setup = agent_setup(run_dir, step)
    assert setup is not None and (setup.rank, setup.world_size, setup.job_id, setup.restart) == (1, 2, "7", 1)
    assert setup.limit == 2 and setup.preempt_signal == "USR2"
    assert agent_setup(_planned(tmp_path / "off", "retry.in_place=0"), step) is None
    assert agent_setup(run_dir, {**step, "SLURM_STEP_NUM_TASKS": "3"}) is None  # the rank names the mismatch


def test_there_is_no_agent_off_slurm_on_the_local_executor_or_inside_one(tmp_path: Path) -> None:
    slurm = {"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0", "SLURM_PROCID": "0", "SLURM_NTASKS": "1"}
    assert agent_setup(tmp_path, {}) is None  # not a Slurm task
    assert agent_setup(tmp_path, {"SLURM_JOB_ID": "7"}) is None  # the batch script, not a step
    assert agent_setup(tmp_path, {**slurm, "SUBMITIT_EXECUTOR": "local"}) is None
    assert agent_setup(tmp_path, {**slurm, "HPC_TRAIN_IN_PLACE_LEFT": "1"}) is None  # already below an agent
    assert agent_setup(tmp_path, slurm) is None  # no plan here: the rank itself says what is wrong
    (tmp_path / "plan.json").write_text(json.dumps({"not": "a plan"}))
    assert agent_setup(tmp_path, slurm) is None


def test_an_agent_that_vanishes_restarts_the_others_at_once_and_without_spares_they_leave_to_slurm(
        tmp_path: Path) -> None:
    """Rank 1's node is lost (its agent killed): rank 0's agent hears it from the coordinator, does not wait for a
    collective on the dead peer to fail (NCCL's default timeout is 10 minutes), restarts, and at the barrier
    finds rank 1's agent gone: without spares the job is left to Slurm and the retry policy."""
    start = time.monotonic()
    rank0, _rank1 = _agents(tmp_path, ["wait-first", "kill-agent"])
    assert time.monotonic() - start < 30, "rank 0 was left waiting for its dead peer"
    assert rank0.returncode == 1, rank0.stderr
    notice = read_notice(tmp_path, "7.0", 1)
    assert notice is not None and notice.failure_class == "infrastructure", notice
    assert "the agent of rank-1 vanished from the job's coordinator" in notice.reason, notice
    log = rank_log_text(tmp_path, 0)
    assert "the agent of rank-1 is gone" in log, log
    worker = int((tmp_path / "worker.pid").read_text())  # what rank 0 started went with it
    assert not Path(f"/proc/{worker}").exists() or "Z" in Path(f"/proc/{worker}/stat").read_text().split(")")[1][:3]
