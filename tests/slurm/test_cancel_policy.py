"""The follower's decision to cancel a job one of whose ranks failed, for every job state and attempt record it
can meet (a pure function), and the facts it reads from a real run folder: it never cancels a job that Slurm,
rank 0's stop or the retry policy is requeuing, and cancels a failure nobody retries, saying why."""

from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path

import pytest

from hpc_train.login.slurm.cancel_policy import REQUEUING_STATES, CancelFacts, decide_cancel, read_facts
from hpc_train.login.slurm.jobstate import FINAL_STATES
from hpc_train.run.attempts import Attempt, AttemptLog
from hpc_train.run.paths import rank_consequence_path, rank_error_path, recovery_claim_path
from hpc_train.run.stops import StopNotice, attempt_key, publish_notice

FAILURE = {"rank": 1, "host": "n2", "time": 100.0, "error": "ValueError('loss is nan')", "requeued": False}
PEER_LOST = {"rank": 0, "host": "n1", "time": 99.0, "error": "RuntimeError('[gloo/transport/tcp/pair.cc:553] "
             "Connection closed by peer [127.0.0.1]:54679')", "requeued": False}
RUNNING = Attempt(attempt=1, job_id="42", restart=0, host="n1", started=50.0, start_step=0)


def facts(state: str = "RUNNING", attempt: Attempt | None = RUNNING, failures: tuple[dict, ...] = (FAILURE,),
          **more: object) -> CancelFacts:
    return CancelFacts("42", state, attempt, failures, **more)  # type: ignore[arg-type]


@pytest.mark.parametrize("state", sorted(REQUEUING_STATES))
def test_a_job_slurm_is_requeuing_is_never_cancelled(state: str) -> None:
    decision = decide_cancel(facts(state))
    assert not decision.cancel and state in decision.reason and "requeued" in decision.reason


@pytest.mark.parametrize(("outcome", "requeued", "words"), [
    ("preempted", True, "recorded as preempted and requeued"), ("preempted", False, "its ranks are leaving"),
    ("hang", True, "recorded as hang and requeued"), ("hang", False, "its ranks are leaving")])
def test_an_attempt_recorded_as_stopped_or_hung_is_never_cancelled(outcome: str, requeued: bool,
                                                                   words: str) -> None:
    attempt = replace(RUNNING, outcome=outcome, requeued=requeued)
    for state in ("RUNNING", "COMPLETING"):
        decision = decide_cancel(facts(state, attempt))
        assert not decision.cancel and words in decision.reason


@pytest.mark.parametrize("phase", ["stopping", "done"])
def test_rank_0_stopping_a_program_that_never_asked_keeps_the_job(phase: str) -> None:
    decision = decide_cancel(facts(stop_phase=phase))
    assert not decision.cancel and f"rank 0 is stopping the attempt for the signal ({phase})" == decision.reason


def test_a_rank_deciding_its_retry_or_an_error_the_policy_requeued_keeps_the_job() -> None:
    assert decide_cancel(facts(deciding_rank=3)).reason == \
        "rank 3 is deciding whether the retry policy requeues its error"
    retried = ({**FAILURE, "rank": 0, "error": "DistBackendError('NCCL unhandled system error')",
                "requeued": True}, FAILURE)
    decision = decide_cancel(facts(failures=retried))
    assert not decision.cancel and decision.reason == "rank 0's error was retried: the job is being requeued"


@pytest.mark.parametrize("outcome", ["running", "failed", "completed", "killed"])
@pytest.mark.parametrize("state", ["RUNNING", "COMPLETING", "CONFIGURING", "FAILED"])
def test_a_failure_nobody_retries_is_cancelled_with_the_first_rank_named(outcome: str, state: str) -> None:
    decision = decide_cancel(facts(state, replace(RUNNING, outcome=outcome)))
    assert decision.cancel
    assert decision.reason == ("rank 1 on n2 failed with ValueError('loss is nan'), which the retry policy does not "
                               "retry, and the other ranks did not stop by themselves")


def test_ranks_that_only_lost_a_peer_wait_for_the_cause_then_the_first_own_error_is_named() -> None:
    """A node that died leaves only "connection closed" on the survivors until Slurm declares NODE_FAIL and
    requeues; the follower waits for that (or for the failing rank's own error) before it cancels."""
    decision = decide_cancel(facts(failures=(PEER_LOST,), waited_s=30))
    assert not decision.cancel
    assert decision.reason == ("rank 0 only lost a peer: waiting up to 120 s for the failing rank's own error or "
                               "Slurm's node-failure requeue")
    assert decide_cancel(facts("NODE_FAIL", failures=(PEER_LOST,), waited_s=500)).cancel  # not requeued by Slurm
    late = decide_cancel(facts(failures=(PEER_LOST,), waited_s=121))
    assert late.cancel and late.reason.startswith("rank 0 on n1 failed with RuntimeError('[gloo")
    both = decide_cancel(facts(failures=(PEER_LOST, FAILURE), waited_s=1))
    assert both.cancel and both.reason.startswith("rank 1 on n2 failed with ValueError")  # the cause, not rank 0


def test_no_failure_of_its_own_is_no_reason_to_cancel() -> None:
    decision = decide_cancel(facts(failures=()))
    assert not decision.cancel and decision.reason == "no rank reported a failure of its own"
    assert not decide_cancel(facts(attempt=None, failures=())).cancel


def test_every_state_sacct_can_report_has_a_decision() -> None:
    for state in sorted(FINAL_STATES | REQUEUING_STATES | {"RUNNING", "COMPLETING", "CONFIGURING", "UNKNOWN"}):
        decision = decide_cancel(facts(state))
        assert decision.reason and decision.cancel == (state not in REQUEUING_STATES)


def _folder(tmp_path: Path) -> Path:
    (tmp_path / "logs").mkdir()
    (tmp_path / "heartbeats").mkdir()
    return tmp_path


def test_the_facts_come_from_the_run_folder_as_this_submission_left_it(tmp_path: Path) -> None:
    run_dir, since = _folder(tmp_path), time.time()
    rank_error_path(run_dir, 3).write_text(json.dumps({**FAILURE, "rank": 3, "time": since - 600}))  # earlier job
    log = AttemptLog(run_dir)
    old = log.begin(job_id="7", restart=0, host="n1", started=since - 900, start_step=0)
    log.finish(old, outcome="failed")
    current = log.begin(job_id="42", restart=2, host="n1", started=since + 1, start_step=40)
    assert read_facts(run_dir, "42", "RUNNING", since) == CancelFacts("42", "RUNNING", current, ())

    rank_consequence_path(run_dir, 0).write_text(json.dumps({**FAILURE, "rank": 0, "time": since + 5}))
    rank_error_path(run_dir, 1).write_text(json.dumps({**FAILURE, "time": since + 6}))
    recovery_claim_path(run_dir, attempt_key("42", 2)).write_text("2\n")
    found = read_facts(run_dir, "42", "RUNNING", since)
    assert [f["rank"] for f in found.failures] == [1]  # the consequence is not a failure; the old error is history
    assert found.deciding_rank == 2 and not decide_cancel(found).cancel
    rank_error_path(run_dir, 2).write_text(json.dumps({**FAILURE, "rank": 2, "time": since + 7}))
    found = read_facts(run_dir, "42", "RUNNING", since)
    assert found.deciding_rank is None and decide_cancel(found).cancel  # it decided: not retried

    publish_notice(run_dir, StopNotice(attempt_key("42", 2), "stopping", since + 8, "SIGUSR2", "scontrol", 0, "why"))
    assert read_facts(run_dir, "42", "RUNNING", since).stop_phase == "stopping"


def test_ranks_restarting_in_place_are_never_cancelled(tmp_path: Path) -> None:
    """A restart notice of the running attempt, or an error the rank left for its agent to mend, keeps the job;
    the errors of a life that was restarted are history once the next life has begun."""
    from hpc_train.run.in_place import RestartNotice, request_restart

    mended = {**PEER_LOST, "restart_in_place": True}
    decision = decide_cancel(facts(failures=(mended,), waited_s=1e6))
    assert not decision.cancel and "mended by an in-place restart" in decision.reason
    AttemptLog(tmp_path).begin(job_id="42", restart=0, host="n1", started=time.time(), start_step=0)
    rank_error_path(tmp_path, 1).parent.mkdir(parents=True)
    rank_error_path(tmp_path, 1).write_text(json.dumps({**FAILURE, "time": time.time(), "in_place": 0}))
    request_restart(tmp_path, attempt_key("42", 0), RestartNotice(1, 1, "n2", "killed", "rank 1 ended on SIGKILL",
                                                                  time.time()))
    read = read_facts(tmp_path, "42", "RUNNING")
    assert read.restarting == "killed: rank 1 ended on SIGKILL"
    assert not decide_cancel(read).cancel and "restarting in place" in decide_cancel(read).reason
    AttemptLog(tmp_path).begin(job_id="42", restart=0, host="n1", started=time.time(), start_step=10, in_place=1)
    read = read_facts(tmp_path, "42", "RUNNING")
    assert read.failures == () and read.restarting is None  # the first life's error is not this life's
