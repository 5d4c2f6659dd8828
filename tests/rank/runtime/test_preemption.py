"""The pieces of preemption handling: the signal flag and its agreement, the requeue decision and the call to
scontrol, the force-exit timer, and the lead time a run folder's measurements give the next plan."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from hpc_train.rank.runtime.preemption import (
    FlagRounds,
    PreemptionWatch,
    Requeue,
    decide_requeue,
    perform_requeue,
)
from hpc_train.run.exit_codes import EXIT_SAVE_HUNG, EXIT_STOPPED, LOCAL_REQUEUE_EXIT
from tests.conftest import REPO


@pytest.fixture
def one_rank_group(tmp_path: Path):
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1, timeout=timedelta(seconds=30))
    yield
    dist.destroy_process_group()


def test_a_signal_only_sets_the_flag_and_handlers_come_back(one_rank_group: None) -> None:
    before = signal.getsignal(signal.SIGUSR2)
    with PreemptionWatch(["usr2"]) as watch:
        assert watch.agreed() == 0
        os.kill(os.getpid(), signal.SIGUSR2)
        os.kill(os.getpid(), signal.SIGTERM)  # a second signal does not replace the first
        assert watch.received == signal.SIGUSR2 and watch.received_at is not None
        assert watch.agreed() == signal.SIGUSR2
    assert signal.getsignal(signal.SIGUSR2) is before


def test_poll_answers_one_step_late_without_waiting(one_rank_group: None) -> None:
    with PreemptionWatch(["USR2"]) as watch:
        assert watch.poll() == 0  # starts the first all-reduce
        os.kill(os.getpid(), signal.SIGUSR2)
        assert watch.poll() == 0  # the all-reduce in flight was started before the signal
        assert watch.poll() == signal.SIGUSR2  # the next one saw it
        watch.settle()


def _ticks_until_flagged(rounds: FlagRounds, raise_at: int, spacing_s: float) -> int:
    """The call at which ``rounds`` returns the flag first raised at call ``raise_at``."""
    for call in range(1, 1000):
        time.sleep(spacing_s)
        if rounds.tick(1 if call >= raise_at else 0):
            rounds.finish()
            return call
    raise AssertionError(f"the flag raised at call {raise_at} was not seen in 1,000 calls")


def test_rounds_of_fast_calls_are_spaced_out_and_still_see_the_flag(one_rank_group: None) -> None:
    """Calls 2 ms apart with rounds of 10 s: after the first rounds, a round every 8 calls (the cap), and a flag
    raised at call 40 is seen at most two rounds later."""
    rounds = FlagRounds(round_s=10.0, max_calls=8)
    seen = _ticks_until_flagged(rounds, 40, 0.002)
    assert rounds.every == 8 and 40 < seen <= 40 + 2 * 8 + 1, (rounds.every, seen)


def test_rounds_of_slow_calls_are_every_call(one_rank_group: None) -> None:
    """Calls slower than a round: a round at every call, and the flag seen one call later."""
    rounds = FlagRounds(round_s=0.01, max_calls=8)
    assert _ticks_until_flagged(rounds, 5, 0.03) == 6 and rounds.every == 1


@pytest.mark.parametrize(("env", "enabled", "before", "action", "code"), [
    ({"SLURM_JOB_ID": "42"}, True, 0, "scontrol", 0),
    ({"SLURM_JOB_ID": "42", "SUBMITIT_EXECUTOR": "local"}, True, 0, "local", LOCAL_REQUEUE_EXIT),
    ({"SUBMITIT_EXECUTOR": "slurm", "SLURM_JOB_ID": "42"}, True, 0, "scontrol", 0),
    ({}, True, 0, "none", EXIT_STOPPED),
    ({"SLURM_JOB_ID": "42"}, False, 0, "none", EXIT_STOPPED),
    ({"SLURM_JOB_ID": "42"}, True, 3, "none", EXIT_STOPPED),
    ({"SLURM_JOB_ID": "42", "HPC_TRAIN_REQUEUE": "dependency"}, True, 0, "dependency", 0),
    ({"SLURM_JOB_ID": "42", "HPC_TRAIN_REQUEUE": "dependency", "SLURM_ARRAY_TASK_ID": "3"}, True, 0, "none",
     EXIT_STOPPED),
])
def test_decide_requeue(env: dict[str, str], enabled: bool, before: int, action: str, code: int) -> None:
    decision = decide_requeue(env, enabled, max_requeues=3, requeued_before=before)
    assert (decision.action, decision.exit_code) == (action, code)
    if before == 3:
        assert "preempt.max_requeues = 3" in decision.reason


def test_after_sigterm_slurm_decides() -> None:
    """A plain scancel sends TERM: requeueing would undo it (scontrol requeue takes back cancelled jobs)."""
    decision = decide_requeue({"SLURM_JOB_ID": "42"}, True, 3, 0, requeue_signal=False)
    assert decision.action == "none" and decision.exit_code == EXIT_STOPPED and "SIGTERM" in decision.reason


def test_the_local_executor_restarts_at_most_five_times() -> None:
    decision = decide_requeue({"SUBMITIT_EXECUTOR": "local"}, True, max_requeues=10, requeued_before=5)
    assert decision.action == "none" and "at most 5 times" in decision.reason


def _fake_scontrol(tmp_path: Path, body: str) -> dict[str, str]:
    folder = tmp_path / "bin"
    folder.mkdir()
    script = folder / "scontrol"
    script.write_text("#!/bin/sh\n" + textwrap.dedent(body))
    script.chmod(0o755)
    return {"PATH": f"{folder}:{os.environ['PATH']}"}


def test_scontrol_requeue_is_called_with_the_job_id(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    record = tmp_path / "args"
    monkeypatch.setenv("PATH", _fake_scontrol(tmp_path, f'echo "$@" > {record}\n')["PATH"])
    decision = perform_requeue(Requeue("scontrol", 0, "scontrol requeue 42"), {"SLURM_JOB_ID": "42"})
    assert decision.action == "scontrol" and record.read_text().strip() == "requeue 42"


def test_a_failing_scontrol_becomes_a_stop_with_its_message(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", _fake_scontrol(tmp_path, 'echo "Requested operation is presently disabled" >&2\n'
                                                        "exit 1\n")["PATH"])
    decision = perform_requeue(Requeue("scontrol", 0, ""), {"SLURM_JOB_ID": "42"})
    assert decision.action == "none" and decision.exit_code == EXIT_STOPPED
    assert "presently disabled" in decision.reason


def test_scontrol_ended_by_the_requeue_it_asked_for_is_a_requeue(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """scontrol runs in the job's step, which the requeue cancels: it may be killed before it exits."""
    monkeypatch.setenv("PATH", _fake_scontrol(tmp_path, "kill -TERM $$\n")["PATH"])
    decision = perform_requeue(Requeue("scontrol", 0, "scontrol requeue 42"), {"SLURM_JOB_ID": "42"})
    assert (decision.action, decision.exit_code, decision.reason) == ("scontrol", 0, "scontrol requeue 42")


def test_without_scontrol_the_stop_says_so(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    decision = perform_requeue(Requeue("scontrol", 0, ""), {"SLURM_JOB_ID": "42"})
    assert decision.exit_code == EXIT_STOPPED and "scontrol is not on PATH" in decision.reason


def test_the_force_exit_timer_ends_a_hung_save() -> None:
    code = ("import time; from hpc_train.rank.runtime.preemption import arm_force_exit\n"
            "arm_force_exit(0.5, print); time.sleep(30)")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60,
                            check=False)
    assert result.returncode == EXIT_SAVE_HUNG
    assert "exiting with status 76" in result.stdout


def test_the_next_plan_takes_its_lead_time_from_the_run_folder(tmp_path: Path) -> None:
    from hpc_train.config.plan import load_job, make_plan
    from hpc_train.config.sites import load_site
    from hpc_train.run.attempts import AttemptLog

    job = tmp_path / "job.toml"
    job.write_text('[job]\nname = "lead"\ntime = "01:00:00"\n')
    site = load_site("local")
    first = make_plan(load_job(job, []), site, "local", cwd=tmp_path)
    log = AttemptLog(Path(first.run_dir))
    Path(first.run_dir).mkdir(parents=True)
    log.finish(log.begin(job_id="1", restart=0, host="n", started=0.0, start_step=0), outcome="preempted",
               step_s_max=40.0, save_s_max=100.0)
    second = make_plan(load_job(job, []), site, "local", cwd=tmp_path)
    assert first.lead_seconds == 60 and second.lead_seconds == 3 * 40 + 150 + 10
    log.finish(log.begin(job_id="2", restart=0, host="n", started=0.0, start_step=0), outcome="preempted",
               save_s_max=3000.0)  # one pathological save: capped at half the hour
    assert make_plan(load_job(job, []), site, "local", cwd=tmp_path).lead_seconds == 1800
