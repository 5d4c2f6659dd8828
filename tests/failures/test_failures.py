"""Failure classes from sacct records and run folders shaped like the ones real jobs leave (every class, and the
precedence cases: a node failure with tracebacks, a NCCL timeout caused by one rank's exception, a hang that was
requeued)."""

from __future__ import annotations

from pathlib import Path

import pytest

from hpc_train.failures.classify import CLASSES, classify
from hpc_train.failures.evidence import Evidence, RankReport, collect_evidence
from tests.failures.fixtures import (
    GLOO_CLOSED,
    NCCL_TIMEOUT,
    Rank,
    comm_traceback,
    record,
    stacks_dump,
    traceback_text,
    user_traceback,
    write_attempts,
    write_batch,
    write_plan,
    write_rank,
)

RAISED = "RuntimeError('injected fault on rank 1 (HPC_TRAIN_INJECT_FAULT=raise:1)')"
SRUN_EXIT = "srun: error: n2: task 1: Exited with exit code 1\nsrun: error: n1: task 0: Exited with exit code 1\n"


def _run(tmp_path: Path) -> Path:
    run_dir = tmp_path / "runs" / "tiny-gpt"
    write_plan(run_dir)
    return run_dir


def _classify(run_dir: Path, rec, job: str = "571", restart: int | None = 0, **kwargs):
    return classify(rec, collect_evidence(run_dir, job, restart), **kwargs)


def test_completed(tmp_path: Path) -> None:
    run_dir = _run(tmp_path)
    write_rank(run_dir, "565", Rank(0, 0, [(5.0, "INFO", "step=300/300 loss=0.9533")]))
    found = _classify(run_dir, record("565", "COMPLETED", steps=(("batch", "COMPLETED", "0:0"),
                                                                 ("0", "COMPLETED", "0:0"))), "565")
    assert found.failure_class == "completed" and found.nodes == () and found.job_id == "565"


def test_a_rank_that_raises_is_a_user_error_on_that_rank_not_on_the_rank_that_lost_it(tmp_path: Path) -> None:
    """Job 571 on the local cluster: rank 1 raised at step 25, rank 0 then lost its peer in an all_gather."""
    run_dir = _run(tmp_path)
    write_rank(run_dir, "571", Rank(0, 0, [(4.0, "INFO", "step=20/300 loss=4.0331")], error=GLOO_CLOSED,
                                    traceback=comm_traceback("RuntimeError: Connection closed by peer"),
                                    error_at=6.6))
    write_rank(run_dir, "571", Rank(1, 1, error=RAISED, traceback=user_traceback(), error_at=5.5))
    write_batch(run_dir, "571", "srun: error: n2: task 1: Exited with exit code 1\nslurmstepd-n1: error: *** STEP "
                "571.0 ON n1 CANCELLED AT 2026-11-30T03:15:36 ***\nsrun: error: n1: task 0: Exited with exit code 1\n")
    found = _classify(run_dir, record("571", "FAILED", "1:0", steps=(("batch", "FAILED", "1:0"),
                                                                     ("0", "FAILED", "1:0"))))
    assert found.failure_class == "user_error"
    assert found.reason == (f"user error: {RAISED} raised on rank 1 (n2) in distributed/faults.py:52")
    assert found.ranks == (1,) and found.nodes == ()  # a user error blames no node
    assert any("rank 0 failed after it" in line for line in found.evidence)


def test_a_nccl_timeout_caused_by_one_ranks_exception_is_that_ranks_user_error(tmp_path: Path) -> None:
    run_dir = _run(tmp_path)
    for rank in (0, 2, 3):  # the others wait in the all-reduce until NCCL's watchdog gives up, 10 minutes later
        write_rank(run_dir, "700", Rank(rank, rank // 2, error=NCCL_TIMEOUT, traceback=comm_traceback(
            "torch.distributed.DistBackendError: Watchdog caught collective operation timeout"), error_at=610.0),
            world=4)
    write_rank(run_dir, "700", Rank(1, 0, error="ValueError('bad')", traceback=user_traceback(
        "ValueError: bad", ("/work/project/train/data.py", 123, "batches")), error_at=10.0), world=4)
    found = _classify(run_dir, record("700", "FAILED", "1:0", nodes="n[1-2]"), "700")
    assert found.failure_class == "user_error"
    assert found.reason == "user error: ValueError('bad') raised on rank 1 (n1) in train/data.py:123"


def test_node_fail_beats_the_tracebacks_of_the_surviving_ranks(tmp_path: Path) -> None:
    """n2 died: the ranks on n1 report their lost peers, the ranks on n2 say nothing more."""
    run_dir = _run(tmp_path)
    for rank in (0, 1):
        write_rank(run_dir, "800", Rank(rank, 0, error=GLOO_CLOSED, traceback=comm_traceback(
            "RuntimeError: Connection closed by peer")), world=4)
    for rank in (2, 3):
        write_rank(run_dir, "800", Rank(rank, 1, [(3.0, "INFO", "step=40/300 loss=3.0")]), world=4)
    rec = record("800", "NODE_FAIL", "0:0", steps=(("batch", "CANCELLED", "0:15"), ("0", "CANCELLED", "0:9")))
    found = _classify(run_dir, rec, "800")
    assert found.failure_class == "node_failure"
    assert found.nodes == ("n2",) and "node failure" in found.reason and "n2" in found.reason
    # What the scheduler says is down wins over the guess from silent ranks
    assert _classify(run_dir, rec, "800", down_nodes={"n1"}).nodes == ("n1",)


def test_node_failure_named_by_slurmstepd(tmp_path: Path) -> None:
    run_dir = _run(tmp_path)
    write_rank(run_dir, "801", Rank(0, 0))
    write_batch(run_dir, "801", "slurmstepd-n1: error: *** JOB 801 ON n2 CANCELLED AT 2026-11-30T03:15:36 DUE TO "
                                "NODE FAILURE ***\n")
    found = _classify(run_dir, record("801", "FAILED", "0:0"), "801")
    assert (found.failure_class, found.nodes) == ("node_failure", ("n2",))


@pytest.mark.parametrize(("state", "expected"), [("PREEMPTED", "preempted"), ("TIMEOUT", "time_limit"),
                                                  ("DEADLINE", "time_limit")])
def test_slurm_preemption_and_time_limit_beat_the_ranks_exit_tracebacks(tmp_path: Path, state: str,
                                                                        expected: str) -> None:
    run_dir = _run(tmp_path)
    write_rank(run_dir, "900", Rank(0, 0, error="KeyboardInterrupt()", traceback="Traceback...\nKeyboardInterrupt\n"))
    write_rank(run_dir, "900", Rank(1, 1, error=GLOO_CLOSED, traceback=comm_traceback("RuntimeError: x")))
    found = _classify(run_dir, record("900", state, "0:15"), "900")
    assert found.failure_class == expected


def test_a_run_that_saved_after_the_signal_and_requeued_itself_was_preempted(tmp_path: Path) -> None:
    run_dir = _run(tmp_path)
    write_rank(run_dir, "372", Rank(0, 0, [(2.0, "INFO", "SIGUSR2 received: saving step 40, then stopping"),
                                           (3.0, "INFO", "saved step 40 0.8 s after SIGUSR2; requeued: scontrol "
                                                         "requeue 372")]))
    rec = record("372", "REQUEUED", steps=(("batch", "CANCELLED", "0:15"), ("0", "FAILED", "75:0")))
    found = _classify(run_dir, rec, "372")
    assert found.failure_class == "preempted" and "saved step 40 after SIGUSR2" in found.reason
    near = record("372", "REQUEUED", steps=(("0", "FAILED", "75:0"),), elapsed_s=1760, limit_s=1800)
    assert _classify(run_dir, near, "372").failure_class == "time_limit"
    assert classify(record("1", "FAILED", "144:0"), Evidence()).failure_class == "preempted"  # local requeue


def test_scancel_that_the_run_saved_for_is_cancelled(tmp_path: Path) -> None:
    run_dir = _run(tmp_path)
    write_rank(run_dir, "373", Rank(0, 0, [(3.0, "INFO", "saved step 12 0.5 s after SIGTERM; not requeued: "
                                                         "SIGTERM: Slurm is ending the job")]))
    found = _classify(run_dir, record("373", "CANCELLED by 1000", "0:0", steps=(("0", "FAILED", "75:0"),)), "373")
    assert found.failure_class == "cancelled" and "uid 1000" in found.reason


def test_cancelled_without_errors_and_the_followers_cancel_after_a_rank_error(tmp_path: Path) -> None:
    run_dir = _run(tmp_path)
    write_rank(run_dir, "374", Rank(0, 0, [(3.0, "INFO", "step=10/300 loss=5.0")]))
    assert _classify(run_dir, record("374", "CANCELLED by 0", "0:15"), "374").failure_class == "cancelled"
    write_rank(run_dir, "375", Rank(1, 1, error=RAISED, traceback=user_traceback()))
    assert _classify(run_dir, record("375", "CANCELLED by 0", "0:15"), "375").failure_class == "user_error"


def test_gpu_out_of_memory_and_the_cgroup_killer(tmp_path: Path) -> None:
    run_dir = _run(tmp_path)
    oom = ("OutOfMemoryError('CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.10 "
           "GiB of which 1.2 GiB is free.')")
    write_rank(run_dir, "500", Rank(0, 0, error=oom, traceback=user_traceback(
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB")))
    write_rank(run_dir, "500", Rank(1, 1, error=NCCL_TIMEOUT, traceback=comm_traceback("DistBackendError"),
                                    error_at=700))
    found = _classify(run_dir, record("500", "FAILED", "1:0"), "500")
    assert found.failure_class == "out_of_memory" and found.ranks == (0,) and "micro_batch" in found.reason

    host = _run(tmp_path / "host")
    write_rank(host, "501", Rank(0, 0, [(3.0, "INFO", "step=10/300 loss=5.0")]))
    write_batch(host, "501", "slurmstepd-n2: error: Detected 1 oom_kill event in StepId=501.0. Some of your "
                             "processes may have been killed by the cgroup out-of-memory handler.\n"
                             "srun: error: n2: task 1: Out Of Memory\n")
    found = _classify(host, record("501", "OUT_OF_MEMORY", "0:125", steps=(("0", "OUT_OF_MEMORY", "0:125"),)), "501")
    assert found.failure_class == "out_of_memory" and found.nodes == ("n2",) and found.ranks == (1,)


@pytest.mark.parametrize("message", [
    "RuntimeError: CUDA error: uncorrectable ECC error encountered",
    "RuntimeError: CUDA error: an illegal memory access was encountered",
    "torch.distributed.DistBackendError: NCCL error in: ProcessGroupNCCL.cpp:1970, unhandled system error "
    "(run with NCCL_DEBUG=INFO for details), NCCL version 2.21.5",
])
def test_gpu_and_network_faults_are_infrastructure_on_that_ranks_node(tmp_path: Path, message: str) -> None:
    run_dir = _run(tmp_path)
    write_rank(run_dir, "600", Rank(3, 1, error=repr(message.split(": ", 1)[1]), traceback=user_traceback(message),
                                    error_at=5.0), world=4)
    for rank in (0, 1, 2):
        write_rank(run_dir, "600", Rank(rank, rank // 2, error=NCCL_TIMEOUT, traceback=comm_traceback(
            "DistBackendError: Watchdog caught collective operation timeout"), error_at=605.0), world=4)
    found = _classify(run_dir, record("600", "FAILED", "1:0"), "600")
    assert found.failure_class == "infrastructure"
    assert found.nodes == ("n2",) and found.ranks == (3,) and "rank 3 (n2)" in found.reason


def test_the_watchdogs_hang_requeued_names_the_rank_outside_the_collective(tmp_path: Path) -> None:
    """Job 570 on the local cluster: rank 1 slept at step 30; the watchdog requeued the job (exit 77)."""
    run_dir = _run(tmp_path)
    write_rank(run_dir, "570", Rank(0, 0, [
        (17.3, "INFO", "hang: no progress for 11 s in step after step 29, noticed by rank 0 (vm) "
                       "(watchdog.step_timeout_s = 10); stacks of every thread in logs/stacks-rank-0.txt"),
        (17.5, "INFO", 'hang: rank 1 is not in a collective: "/work/main/hpc_train/distributed/faults.py", line 55 in '
                       "maybe_inject_fault"),
        (17.6, "INFO", "hang: exiting with status 77: requeued (hang 1 of retry.hang = 1): scontrol requeue 570")],
        stacks=stacks_dump(0, ["/venv/site-packages/torch/distributed/distributed_c10d.py"])))
    write_rank(run_dir, "570", Rank(1, 1, [(17.4, "INFO", "hang: no progress for 11 s")],
                                    stacks=stacks_dump(1, ["/work/main/hpc_train/distributed/faults.py"])))
    write_attempts(run_dir, [{"job_id": "570", "started": 0, "outcome": "hang", "requeued": True,
                              "note": "no progress for 11 s in step after step 29"}])
    rec = record("570", "REQUEUED", steps=(("batch", "CANCELLED", "0:15"), ("0", "FAILED", "77:0")))
    found = _classify(run_dir, rec, "570")
    assert found.failure_class == "hang"
    assert found.ranks == (1,) and found.nodes == ("n2",) and "rank 1 not in a collective on n2" in found.reason
    assert any("stacks dumped by rank 0-1" in line for line in found.evidence)


def test_hang_suspects_from_the_stacks_alone(tmp_path: Path) -> None:
    run_dir = _run(tmp_path)
    for rank, frame in ((0, "/v/torch/distributed/distributed_c10d.py"), (1, "/v/deepspeed/comm/comm.py"),
                        (2, "/work/project/train/data.py"), (3, "/v/torch/distributed/c10d_logger.py")):
        write_rank(run_dir, "571", Rank(rank, rank // 2, stacks=stacks_dump(rank, [frame])), world=4)
    found = _classify(run_dir, record("571", "FAILED", "77:0"))
    assert (found.failure_class, found.ranks, found.nodes) == ("hang", (2,), ("n2",))


def test_collective_timeouts_without_a_cause_are_a_hang_on_the_silent_rank(tmp_path: Path) -> None:
    run_dir = _run(tmp_path)
    for rank in (0, 1, 3):
        write_rank(run_dir, "572", Rank(rank, rank // 2, error=NCCL_TIMEOUT, traceback=comm_traceback(
            "DistBackendError: Watchdog caught collective operation timeout"), error_at=600.0), world=4)
    write_rank(run_dir, "572", Rank(2, 1, [(3.0, "INFO", "step=10/300 loss=5.0")]), world=4)
    found = _classify(run_dir, record("572", "FAILED", "1:0"), "572")
    assert (found.failure_class, found.ranks, found.nodes) == ("hang", (2,), ("n2",))
    assert "timed out on rank 0-1,3" in found.reason


def test_a_save_that_hung_after_the_signal(tmp_path: Path) -> None:
    found = classify(record("573", "FAILED", "76:0"), Evidence())
    assert found.failure_class == "hang" and "exit 76" in found.reason


def test_a_rank_killed_from_outside_is_killed_and_named(tmp_path: Path) -> None:
    """``kill -9`` of rank 1 on n2: srun says "Killed", rank 0 only lost its peer."""
    run_dir = _run(tmp_path)
    write_rank(run_dir, "574", Rank(0, 0, error=GLOO_CLOSED, traceback=comm_traceback("RuntimeError: x")))
    write_rank(run_dir, "574", Rank(1, 1))
    write_batch(run_dir, "574", "srun: error: n2: task 1: Killed\n")
    found = _classify(run_dir, record("574", "FAILED", "0:9", steps=(("0", "FAILED", "0:9"),)), "574")
    assert found.failure_class == "killed" and found.ranks == (1,) and found.nodes == ("n2",)
    assert found.reason.startswith("killed: SIGKILL from outside the program") and "rank 1 on n2" in found.reason
    assert "Killed" in found.reason


def test_the_sigterm_srun_sends_the_others_is_not_taken_for_the_death() -> None:
    """srun terminates the other tasks once one dies: task 0's SIGTERM line is a consequence of task 1's kill."""
    lost = RankReport(rank=0, host="n1", error=GLOO_CLOSED, traceback=comm_traceback("RuntimeError: x"))
    both = Evidence(ranks=(lost, RankReport(rank=1, host="n2")),
                    batch_log="srun: error: n1: task 0: Terminated\nsrun: error: n2: task 1: Killed\n")
    found = classify(record("575", "FAILED", "0:9"), both)
    assert found.ranks == (1,) and found.reason.startswith("killed: SIGKILL from outside the program"), found


def test_with_an_agent_per_node_srun_s_task_is_a_node_and_its_silent_rank_is_named() -> None:
    """Where a node's agent starts its ranks (``retry.in_place``), srun's task 1 is node 1, holding ranks 2 and 3
    with two per node: the agent died of rank 3's SIGKILL (its restarts spent), rank 2 only lost its peer."""
    lost = [RankReport(rank=rank, host=f"n{1 + rank // 2}", error=GLOO_CLOSED,
                       traceback=comm_traceback("RuntimeError: x")) for rank in (0, 1, 2)]
    evidence = Evidence(ranks=(*lost, RankReport(rank=3, host="n2")), ranks_per_task=2,
                        batch_log="srun: error: n1: task 0: Terminated\nsrun: error: n2: task 1: Killed\n")
    found = classify(record("577", "FAILED", "0:9"), evidence)
    assert (found.failure_class, found.ranks, found.nodes) == ("killed", (3,), ("n2",)), found
    assert "rank 3 on n2" in found.reason, found.reason


def test_the_ranks_per_srun_task_come_from_the_plan(tmp_path: Path) -> None:
    from hpc_train.failures.evidence import ranks_per_task

    assert ranks_per_task(tmp_path) == 1  # no plan: srun's tasks are ranks, as they always were
    for sets, per_task in ((("job.tasks_per_node=2",), 2), (("job.tasks_per_node=2", "retry.in_place=0"), 1)):
        folder = tmp_path / str(len(sets))
        folder.mkdir()
        (folder / "plan.json").write_text(_plan_json(tmp_path, *sets))
        assert ranks_per_task(folder) == per_task, sets


def _plan_json(tmp_path: Path, *sets: str) -> str:
    from hpc_train.config.plan import load_job, make_plan
    from hpc_train.config.sites import load_site
    from tests.conftest import REPO

    cfg = load_job(REPO / "examples" / "tiny_gpt.toml", ["job.nodes=2", *sets])
    return make_plan(cfg, load_site("local-slurm"), "slurm", cwd=tmp_path).to_json()


def test_when_srun_wrote_only_the_consequence_the_rank_that_left_nothing_is_named() -> None:
    """Under load srun can be force-terminated before it writes the dead task's line: its only line is task 0's
    SIGTERM, task 0 only lost its peer, and rank 1 left no error at all: rank 1 is named, its signal is not."""
    lost = RankReport(rank=0, host="n1", error=GLOO_CLOSED, traceback=comm_traceback("RuntimeError: x"))
    silent = RankReport(rank=1, node_index=1)  # no error record: no host of its own, only its log's node index
    evidence = Evidence(ranks=(lost, silent), batch_log="srun: error: n1: task 0: Terminated\n")
    found = classify(record("576", "FAILED", "15:0"), evidence)
    assert (found.failure_class, found.ranks, found.nodes) == ("killed", (1,), ("n2",)), found
    assert found.reason.startswith("killed: a signal srun did not name: rank 1 on n2 ended without a traceback "
                                   "(no srun line for it; rank 0 on n1 only lost its peer"), found.reason
    assert "rank 1 on n2: no srun line for it" in found.evidence[-1], found.evidence
    assert not any(line.startswith("srun: n2") for line in found.evidence), found.evidence


@pytest.mark.parametrize(("words", "signal"), [("Segmentation fault (core dumped)", "SIGSEGV"),
                                               ("Bus error", "SIGBUS"), ("Aborted (core dumped)", "SIGABRT")])
def test_a_rank_that_crashed_in_native_code_is_crashed(tmp_path: Path, words: str, signal: str) -> None:
    run_dir = _run(tmp_path)
    write_rank(run_dir, "578", Rank(0, 0, error=GLOO_CLOSED, traceback=comm_traceback("RuntimeError: x")))
    write_rank(run_dir, "578", Rank(1, 1))
    write_batch(run_dir, "578", f"srun: error: n2: task 1: {words}\n")
    found = _classify(run_dir, record("578", "FAILED", "0:11", steps=(("0", "FAILED", "0:11"),)), "578")
    assert (found.failure_class, found.ranks, found.nodes) == ("crashed", (1,), ("n2",))
    assert found.reason.startswith(f"crashed: {signal} in native code")


@pytest.mark.parametrize(("exit_code", "kind"), [("0:9", "killed"), ("0:11", "crashed"), ("137:0", "killed"),
                                                 ("135:0", "crashed")])
def test_a_signal_in_the_exit_status_alone_names_the_class(exit_code: str, kind: str) -> None:
    """No srun line (a local run, a batch log that is gone): the signal in Slurm's exit code, or 128 + N."""
    found = classify(record("579", "FAILED", exit_code), Evidence())
    assert found.failure_class == kind and "without a traceback" in found.reason


def test_the_cgroup_oom_killer_is_out_of_memory_not_killed(tmp_path: Path) -> None:
    """SIGKILL from the job's own memory limit: rule 4 (out of memory) comes before the signal classes."""
    run_dir = _run(tmp_path)
    write_rank(run_dir, "580", Rank(1, 1))
    write_batch(run_dir, "580", "slurmstepd-n2: error: Detected 1 oom_kill event in StepId=580.0. Some of the "
                "step tasks have been OOM Killed.\nsrun: error: n2: task 1: Out Of Memory\n")
    found = _classify(run_dir, record("580", "OUT_OF_MEMORY", "0:125"), "580")
    assert found.failure_class == "out_of_memory" and "job.mem" in found.reason


def test_the_agents_peak_line_says_how_close_the_rank_came_to_the_limit(tmp_path: Path) -> None:
    """The agent above a rank logs what the rank and its cgroup peaked at (hpc_train.run.host_memory); the
    message carries it, even where Slurm's accounting has not seen the kill (a plain FAILED, no batch line)."""
    from hpc_train.run.loglines import format_host_oom

    run_dir = _run(tmp_path)
    write_rank(run_dir, "581", Rank(1, 1, [(3.0, "ERROR", format_host_oom(1, int(3.2 * 2**30), int(3.99 * 2**30),
                                                                           4 * 2**30))]))
    found = _classify(run_dir, record("581", "FAILED", "0:9"), "581")
    assert found.failure_class == "out_of_memory", found
    assert "(rank 1 peaked at 3.20 GiB, its cgroup at 3.99 of 4.00 GiB); not retried unchanged: raise job.mem" \
        in found.reason, found.reason


def test_ranks_that_could_not_start(tmp_path: Path) -> None:
    assert classify(record("575", "FAILED", "127:0"), Evidence()).failure_class == "user_error"
    evidence = Evidence(batch_log="hpc_train.launch: WORLD_SIZE=4 but the plan has 8 ranks\n")
    found = classify(record("576", "FAILED", "1:0"), evidence)
    assert found.failure_class == "user_error" and "WORLD_SIZE=4" in found.reason


def test_nothing_known_is_unknown_and_says_where_to_look() -> None:
    found = classify(record("577", "FAILED", "1:0"), Evidence())
    assert found.failure_class == "unknown" and "hpc_train logs" in found.reason
    assert classify(None, Evidence()).failure_class == "unknown"
    assert {found.failure_class} <= set(CLASSES)


def test_info_lines_that_name_nccl_are_not_evidence() -> None:
    report = RankReport(0, log_tail=("2026-11-30 03:15:03,129 rank0 INFO fabric: NCCL_IB_HCA=mlx5_0 NET/IB",
                                     "2026-11-30 03:15:04,129 rank0 WARNING fabric: unhandled system error seen "
                                     "before; fix: x"))
    assert classify(record("578", "COMPLETED"), Evidence((report,))).failure_class == "completed"


def test_each_attempt_of_a_requeued_job_is_read_from_its_own_part_of_the_log(tmp_path: Path) -> None:
    run_dir = _run(tmp_path)
    write_rank(run_dir, "579", Rank(0, 0, [(2.0, "INFO", "saved step 40 0.8 s after SIGUSR2; requeued")]))
    write_rank(run_dir, "579", Rank(0, 0, error="ValueError('bad')", traceback=user_traceback("ValueError: bad")),
               restart=1, start_at=30.0)
    first = _classify(run_dir, record("579", "REQUEUED", steps=(("0", "FAILED", "75:0"),)), "579", restart=0)
    second = _classify(run_dir, record("579", "FAILED", "1:0"), "579", restart=1)
    assert first.failure_class == "preempted"
    assert second.failure_class == "user_error"
    # the error file belongs to the newest attempt only
    assert collect_evidence(run_dir, "579", 0).ranks[0].error == ""


def test_rank_stderr_in_the_batch_output_counts_for_a_rank_without_an_error_file(tmp_path: Path) -> None:
    run_dir = _run(tmp_path)
    write_batch(run_dir, "580", "[rank1]: Traceback (most recent call last):\n[rank1]:   File \"x.py\", line 3, in "
                                "f\n[rank1]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 4 GiB\n")
    found = _classify(run_dir, record("580", "FAILED", "1:0"), "580")
    assert found.failure_class == "out_of_memory" and found.ranks == (1,)


def test_to_dict_names_the_class() -> None:
    data = classify(record("581", "CANCELLED by 0"), Evidence()).to_dict()
    assert data["class"] == "cancelled" and "failure_class" not in data


def test_classes_are_exactly_the_documented_ones() -> None:
    assert set(CLASSES) == {"completed", "preempted", "time_limit", "node_failure", "infrastructure",
                            "out_of_memory", "hang", "killed", "crashed", "user_error", "cancelled", "unknown"}


def test_traceback_helper_shape() -> None:  # the fixtures look like Python's own tracebacks
    text = traceback_text([("a.py", 1, "f")], "ValueError: x")
    assert text.splitlines()[0] == "Traceback (most recent call last):" and text.endswith("ValueError: x\n")


# -- issue 39: numbers no int or range should take, in the evidence ----------------------------------------------


def test_srun_task_ranges_and_signals_out_of_range_are_damage_not_a_hang(tmp_path: Path) -> None:
    from hpc_train.failures.evidence import srun_tasks
    from hpc_train.failures.signal_deaths import srun_signal

    assert srun_tasks("srun: error: n1: tasks 0-99999999999: Killed") == {}
    assert srun_tasks(f"srun: error: n1: tasks {'9' * 5000}: Killed\nsrun: error: n2: tasks 1-2: Killed") == {
        1: ("n2", "1-2", "Killed"), 2: ("n2", "1-2", "Killed")}
    assert srun_signal(f"signal {'9' * 5000}") is None and srun_signal("signal 7") == 7


def test_a_5000_digit_rank_in_any_line_of_the_evidence_is_skipped(tmp_path: Path) -> None:
    run_dir = _run(tmp_path)
    huge = "9" * 5000
    write_rank(run_dir, "571", Rank(1, 1, lines=[(1.0, "WARNING", f"hang: rank {huge} is not in a collective: x"),
                                                 (2.0, "ERROR", f"out of memory: rank {huge} was killed by the memory "
                                                                "limit of its cgroup; its largest process peaked at "
                                                                "1.2.3 GiB"),
                                                 (3.0, "INFO", f"start: srun rank {huge}/2 (local 0/1, node 0/1) job "
                                                               "571 restart 0")],
                                    error=RAISED, traceback=user_traceback(), error_at=5.0))
    write_batch(run_dir, "571", f"[rank{huge}]: boom\nsrun: error: n1: task {huge}: signal {huge}\n")
    path = run_dir / "logs" / "rank-1.error.json"
    path.write_text(path.read_text().replace('"time": ', '"time": 1e308, "was": '))
    found = _classify(run_dir, record("571", "FAILED", "1:0"))
    assert found.failure_class in CLASSES
