"""The node agent that restarts ranks inside the job (hpc_train.rank.agent), with real processes as its ranks: each
agent starts its node's ranks with their SLURM_* places; a rank that dies of SIGKILL makes every agent end its
ranks (and what they started) and start them again; a program's own error, or a kill once ``retry.in_place`` is
spent, ends the node's other ranks and leaves as the rank did."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from hpc_train.rank.agent.agent import agent_setup
from hpc_train.run.attempts import AttemptLog
from hpc_train.run.in_place import read_notice
from hpc_train.run.node_log import rank_log_text

AGENT = """
import sys
from pathlib import Path

import pytest
from hpc_train.rank.agent.agent import AgentSetup, supervise
run_dir, node, nodes, per_node, limit, restart = Path(sys.argv[1]), *map(int, sys.argv[2:7])
names = tuple(f"n{index}" for index in range(nodes))
setup = AgentSetup(run_dir, node, names, nodes * per_node, "7", restart, limit, "USR2", per_node)
sys.exit(supervise(setup, sys.argv[7:]))
"""

RANK = textwrap.dedent("""
    import os, signal, subprocess, sys, time
    run_dir, modes, rank = sys.argv[1], sys.argv[2].split(","), os.environ["SLURM_PROCID"]
    mode, life = modes[int(rank)], os.environ["HPC_TRAIN_IN_PLACE"]
    with open(os.path.join(run_dir, "places.txt"), "a") as places:
        names = ("SLURM_PROCID", "SLURM_LOCALID", "SLURM_NODEID", "SLURM_NTASKS", "SLURM_STEP_TASKS_PER_NODE",
                 "SLURM_STEP_NODELIST")
        places.write(" ".join(os.environ[name] for name in names) + "\\n")
    with open(os.path.join(run_dir, "lives.txt"), "a") as lives:
        lives.write(f"{rank} {life} {os.environ['HPC_TRAIN_IN_PLACE_LEFT']}\\n")
    if mode == "user-error":
        sys.exit(1)
    if mode == "error-first" and life == "0":  # the program's own error, just before its sibling is killed
        time.sleep(0.2)
        sys.exit(1)
    if mode == "exit-76":  # a save that hung (EXIT_SAVE_HUNG), a moment after its sibling's own error
        time.sleep(0.5)
        sys.exit(76)
    if mode == "net-fault" and life == "0":  # as launch records a network fault below a node's agent, and asks
        from pathlib import Path  # for a restart in place
        from hpc_train.run.error_log import append_error
        from hpc_train.run.exit_codes import EXIT_RESTART_IN_PLACE
        append_error(Path(run_dir), os.environ["HPC_TRAIN_ERROR_LOG"], {"rank": int(rank), "job_id": "7",
                     "error": "RuntimeError('NCCL error: unhandled system error')", "time": time.time()})
        sys.exit(EXIT_RESTART_IN_PLACE)
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
        with open(os.path.join(run_dir, f"worker-{rank}.pid"), "w") as out:
            out.write(str(worker.pid))
        while True:
            time.sleep(1)  # blocked in a collective with the dead peer
""")


def _agents(tmp_path: Path, modes: list[str], limit: int = 2, per_node: int = 1, restart: int = 0
            ) -> list[subprocess.CompletedProcess[str]]:
    """One agent per node, ``per_node`` ranks each; ``modes``: each rank's, in rank order."""
    rank_script = tmp_path / "rank.py"
    rank_script.write_text(RANK)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    env.pop("HPC_TRAIN_IN_PLACE_LEFT", None)
    nodes = len(modes) // per_node
    procs = [subprocess.Popen([sys.executable, "-c", AGENT, str(tmp_path), str(node), str(nodes), str(per_node),
                               str(limit), str(restart), sys.executable, str(rank_script), str(tmp_path),
                               ",".join(modes)],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for node in range(nodes)]
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        results.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
    return results


def _gone(pid_file: Path) -> bool:
    """Whether the process whose pid ``pid_file`` holds has ended (gone, or a zombie of a dead parent)."""
    worker = int(pid_file.read_text())
    return not Path(f"/proc/{worker}").exists() or "Z" in Path(f"/proc/{worker}/stat").read_text().split(")")[1][:3]


def _lives(tmp_path: Path) -> list[str]:
    return sorted((tmp_path / "lives.txt").read_text().splitlines())


def test_a_killed_rank_restarts_every_rank_and_nothing_of_the_old_life_is_left(tmp_path: Path) -> None:
    AttemptLog(tmp_path).begin(job_id="7", restart=0, host="n1", started=1.0, start_step=0)
    rank0, rank1 = _agents(tmp_path, ["wait-first", "kill-first"])
    assert rank0.returncode == 0 and rank1.returncode == 0, rank0.stderr + rank1.stderr
    assert _lives(tmp_path) == ["0 0 2", "0 1 1", "1 0 2", "1 1 1"]  # both ranks lived twice
    assert _gone(tmp_path / "worker-0.pid")
    notice = read_notice(tmp_path, "7.0", 1)
    assert notice is not None and notice.rank == 1 and notice.failure_class == "killed", notice
    assert "SIGKILL" in notice.reason
    (first,) = AttemptLog(tmp_path).read()
    assert first.outcome == "killed" and "restarted in place (1 of retry.in_place = 2)" in first.note, first
    log = rank_log_text(tmp_path, 0)
    assert "in-place restart 1 of 2 (retry.in_place): killed" in log, log
    # node 0's agent hosted the coordinator: the barrier went over the network, not through per-rank markers
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
    assert _gone(tmp_path / "worker-1.pid")
    log = rank_log_text(tmp_path, 1)
    assert "ending the ranks of node n1: this job's run goes on as job 8" in log, log


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


def test_the_srun_task_of_each_node_gets_an_agent_with_the_plans_limit(tmp_path: Path) -> None:
    run_dir = _planned(tmp_path)
    step = {"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0", "SLURM_PROCID": "1", "SLURM_NODEID": "1",
            "SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_NODELIST": "n[1-2]", "SLURMD_NODENAME": "n2",
            "SLURM_RESTART_COUNT": "1"}
    setup = agent_setup(run_dir, step)
    assert setup is not None and (setup.node, setup.nodes, setup.world_size) == (1, ("n1", "n2"), 2), setup
    assert (setup.job_id, setup.restart, setup.limit, setup.preempt_signal) == ("7", 1, 2, "USR2")
    assert setup.member == "node-1@n2"
    assert agent_setup(_planned(tmp_path / "off", "retry.in_place=0"), step) is None
    assert agent_setup(run_dir, {**step, "SLURM_STEP_NUM_TASKS": "3"}) is None  # the rank names the mismatch
    four = agent_setup(_planned(tmp_path / "four", "job.tasks_per_node=2"), step)  # one task per node, two ranks
    assert four is not None and (four.tasks_per_node, four.world_size, four.cpus_per_rank) == (2, 4, 2), four
    assert agent_setup(run_dir, {**step, "SLURM_STEP_NUM_TASKS": "4"}) is None  # a task per rank: no node agent


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
    """Node 1 is lost (its agent killed): node 0's agent hears it from the coordinator, does not wait for a
    collective on the dead peer to fail (NCCL's default timeout is 10 minutes), restarts, and at the barrier
    finds node 1's agent gone: without spares the job is left to Slurm and the retry policy."""
    start = time.monotonic()
    rank0, _rank1 = _agents(tmp_path, ["wait-first", "kill-agent"])
    assert time.monotonic() - start < 30, "rank 0 was left waiting for its dead peer"
    assert rank0.returncode == 1, rank0.stderr
    notice = read_notice(tmp_path, "7.0", 1)
    assert notice is not None and notice.failure_class == "infrastructure", notice
    assert "the agent of node-1@n1 vanished from the job's coordinator" in notice.reason, notice
    log = rank_log_text(tmp_path, 0)
    assert "the agent of node-1@n1 is gone" in log, log
    assert _gone(tmp_path / "worker-0.pid")  # what rank 0 started went with it


def test_a_node_agent_starts_each_of_its_ranks_with_the_place_srun_would_have_given_it(tmp_path: Path) -> None:
    """Two nodes of two ranks: one agent each, four ranks, each with its own SLURM_* place, and one rank killed
    restarts all four (one barrier arrival per node)."""
    results = _agents(tmp_path, ["wait-first", "ok", "ok", "kill-first"], per_node=2)
    assert [r.returncode for r in results] == [0, 0], [r.stderr for r in results]
    places = sorted(set((tmp_path / "places.txt").read_text().splitlines()))
    assert places == [f"{rank} {rank % 2} {rank // 2} 4 2(x2) n[0-1]" for rank in range(4)], places
    assert _lives(tmp_path) == [f"{rank} {life} {2 - life}" for rank in range(4) for life in (0, 1)]
    notice = read_notice(tmp_path, "7.0", 1)
    assert notice is not None and notice.rank == 3 and notice.failure_class == "killed", notice
    assert _gone(tmp_path / "worker-0.pid")


def test_a_rank_that_fails_on_its_own_ends_its_node_s_other_ranks_and_the_agent_leaves_with_its_status(
        tmp_path: Path) -> None:
    """The program's own error on rank 1: no restart; rank 0 on the same node, blocked in a collective with it,
    is ended by the agent (as srun's --kill-on-bad-exit ends the other nodes'), and the agent leaves with 1."""
    start = time.monotonic()
    (only,) = _agents(tmp_path, ["wait-first", "user-error"], per_node=2)
    assert time.monotonic() - start < 60, "rank 0 was left running"
    assert only.returncode == 1, only.stderr
    assert _lives(tmp_path) == ["0 0 2", "1 0 2"]
    assert read_notice(tmp_path, "7.0", 1) is None
    assert _gone(tmp_path / "worker-0.pid")


def test_a_node_s_ranks_record_their_errors_in_one_file_that_the_agent_reads_and_clears(tmp_path: Path) -> None:
    """Rank 1 records a network fault in its node's ``errors-0-1.jsonl`` (no per-rank file) and asks for a
    restart: the agent reads the cause from that file, restarts both ranks, and clears the file before the next
    life starts. In a requeued attempt (restart 1) the first life's clearing keeps the last attempt's file aside
    for rank 0's look-back instead."""
    logs = tmp_path / "logs"
    logs.mkdir(mode=0o700)
    (logs / "errors-0-1.jsonl").write_text('{"rank": 0, "error": "the last attempt\'s"}\n')
    (only,) = _agents(tmp_path, ["ok", "net-fault"], per_node=2, restart=1)
    assert only.returncode == 0, only.stderr
    notice = read_notice(tmp_path, "7.1", 1)
    assert notice is not None and notice.rank == 1 and notice.failure_class == "infrastructure", notice
    assert "NCCL error: unhandled system error" in notice.reason, notice
    assert (logs / "prev-errors-0-1.jsonl").read_text() == '{"rank": 0, "error": "the last attempt\'s"}\n'
    assert not (logs / "errors-0-1.jsonl").exists()  # life 1 began with it cleared, and nothing failed in it
    assert not list(logs.glob("rank-*.error.json"))


def test_a_kill_on_a_node_restarts_even_when_its_sibling_failed_on_its_own_a_moment_before(tmp_path: Path) -> None:
    """Rank 0 exits with its own error, rank 1 of the same node is SIGKILLed 0.3 s later: as when each rank had
    an agent (the killed rank's would have asked for the restart), the kill decides, and both ranks restart."""
    (only,) = _agents(tmp_path, ["error-first", "kill-first"], per_node=2)
    assert only.returncode == 0, only.stderr
    assert _lives(tmp_path) == ["0 0 2", "0 1 1", "1 0 2", "1 1 1"]
    notice = read_notice(tmp_path, "7.0", 1)
    assert notice is not None and notice.rank == 1 and notice.failure_class == "killed", notice


def test_a_node_leaves_with_the_highest_status_of_its_ranks_as_srun_reports_a_step(tmp_path: Path) -> None:
    (only,) = _agents(tmp_path, ["user-error", "exit-76"], per_node=2)
    assert only.returncode == 76, only.stderr


def test_a_rank_gets_its_own_place_and_none_of_the_node_task_s(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """srun's node task may carry an MPI plugin's rank (a site's MpiDefault), which the launcher detection reads
    before SLURM_PROCID: each rank gets its own place and not that; a site's MPI settings stay."""
    from hpc_train.rank.agent.agent import Agent, AgentSetup
    from hpc_train.run.assignment import Assignment, rank_environments

    for name, value in (("PMI_RANK", "1"), ("PMIX_RANK", "1"), ("SLURM_GTIDS", "1"), ("OMPI_MCA_btl", "^openib")):
        monkeypatch.setenv(name, value)
    setup = AgentSetup(tmp_path, 1, ("n0", "n1"), 4, "7", 0, 2, "USR2", 2, None, 3)
    places = rank_environments(Assignment(0, list(setup.nodes)), setup.node_name, 2)
    envs = Agent(setup).rank_environments(places, {"HPC_TRAIN_IN_PLACE": "0"})
    assert sorted(envs) == [2, 3]
    for rank, env in envs.items():
        place = (env["SLURM_PROCID"], env["SLURM_LOCALID"], env["SLURM_CPUS_PER_TASK"])
        assert place == (str(rank), str(rank - 2), "3")
        assert env["HPC_TRAIN_ERROR_LOG"] == "errors-2-3.jsonl" and env["OMPI_MCA_btl"] == "^openib"
        assert not {"PMI_RANK", "PMIX_RANK", "SLURM_GTIDS"} & set(env)
