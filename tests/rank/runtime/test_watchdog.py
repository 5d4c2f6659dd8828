"""The hang watchdog, the straggler check and injected faults, in one process with short timeouts."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest

from hpc_train.failures.policy import RetryPolicy
from hpc_train.rank.distributed import faults
from hpc_train.rank.distributed.launchers import LaunchInfo
from hpc_train.rank.runtime import watchdog
from hpc_train.rank.runtime.stopping import AttemptRecorder, decide_hang
from hpc_train.rank.runtime.watchdog import Hang, Timeouts, Watchdog, suspects
from hpc_train.rank.train.stragglers import find_straggler
from hpc_train.run.attempts import AttemptLog
from hpc_train.run.exit_codes import EXIT_HUNG, EXIT_RESTART_IN_PLACE, LOCAL_REQUEUE_EXIT
from hpc_train.run.paths import stacks_path

SHORT = Timeouts(startup=0.6, step=0.6, checkpoint=0.6)
LONG = Timeouts(startup=60, step=60, checkpoint=60)


def _run_dir(tmp_path: Path) -> Path:
    (tmp_path / "logs").mkdir()
    return tmp_path


class Exits:
    """Stands in for os._exit: records the status and lets the watchdog thread end."""

    def __init__(self) -> None:
        self.codes: list[int] = []
        self.done = threading.Event()

    def __call__(self, code: int) -> None:
        self.codes.append(code)
        self.done.set()


def test_progress_keeps_the_watchdog_quiet(tmp_path: Path) -> None:
    exits = Exits()
    with Watchdog(_run_dir(tmp_path), 0, 1, "1.0", SHORT, None, lambda _: None, poll_s=0.05, exit=exits) as dog:
        for step in range(1, 16):
            time.sleep(0.1)
            dog.enter("step", step)
    assert exits.codes == [] and not stacks_path(tmp_path, 0).exists()
    # No heartbeat files: a rank making progress writes nothing into the run folder (docs/performance.md).
    assert list(tmp_path.glob("heartbeats/*")) == []


def test_a_hang_dumps_every_rank_and_rank_0_decides_for_all(tmp_path: Path) -> None:
    """Rank 1 stops making progress; rank 0 (long timeouts) learns of it from the marker, dumps its stacks,
    decides once, and both ranks leave with rank 0's status."""
    run_dir = _run_dir(tmp_path)
    decisions: list[Hang] = []

    def decide(hang: Hang) -> tuple[int, str]:
        decisions.append(hang)
        return LOCAL_REQUEUE_EXIT, "requeued"

    exits0, exits1 = Exits(), Exits()
    logs: list[str] = []
    rank0 = Watchdog(run_dir, 0, 2, "7.0", LONG, decide, logs.append, poll_s=0.05, exit=exits0)
    rank1 = Watchdog(run_dir, 1, 2, "7.0", SHORT, None, logs.append, poll_s=0.05, exit=exits1)
    start = time.monotonic()
    with rank0, rank1:
        rank1.enter("step", 12)
        assert exits1.done.wait(20) and exits0.done.wait(20)
    assert time.monotonic() - start < 15
    assert exits0.codes == exits1.codes == [LOCAL_REQUEUE_EXIT]
    [hang] = decisions
    assert hang.rank == 1 and hang.phase == "step" and hang.step == 12 and hang.waited_s >= 0.6
    for rank in (0, 1):
        dump = stacks_path(run_dir, rank).read_text()
        assert "# main thread 0x" in dump and "test_watchdog.py" in dump
    assert any("exiting with status 144" in line for line in logs)


def test_a_restart_under_the_same_name_ignores_the_earlier_hang(tmp_path: Path) -> None:
    """The local executor restarts a job under the same job id and restart 0: the old marker and decision must
    neither stop the new attempt nor answer for its own hang."""
    run_dir = _run_dir(tmp_path)
    (run_dir / "heartbeats").mkdir()
    old = Hang(1, "n2", "step", 3, 31.0, 30.0, time.time() - 3600)
    (run_dir / "heartbeats" / "hang-7.0.json").write_text(json.dumps(old.__dict__))
    (run_dir / "heartbeats" / "hang-7.0.decided.json").write_text(json.dumps(
        {"hang": old.time, "exit_code": LOCAL_REQUEUE_EXIT, "reason": "old"}))
    (run_dir / "heartbeats" / "hang-7.0.partial.json").write_text('{"rank": 1, "ho')
    exits = Exits()
    with Watchdog(run_dir, 0, 1, "7.0", LONG, None, lambda _: None, poll_s=0.05, exit=exits):
        time.sleep(0.4)
    assert exits.codes == []
    exits1 = Exits()
    with Watchdog(run_dir, 1, 2, "7.0", SHORT, None, lambda _: None, poll_s=0.05, grace_s=1.0, exit=exits1):
        assert exits1.done.wait(10)
    assert exits1.codes == [EXIT_HUNG]  # the old decision (144) was not taken for this hang
    assert json.loads((run_dir / "heartbeats" / "hang-7.0.json").read_text())["step"] == 0


def test_the_watchdog_exits_even_when_the_decision_fails(tmp_path: Path) -> None:
    def decide(_: Hang) -> tuple[int, str]:
        raise OSError("disk full")

    exits = Exits()
    logs: list[str] = []
    with Watchdog(_run_dir(tmp_path), 0, 1, "9.0", SHORT, decide, logs.append, poll_s=0.05, exit=exits):
        assert exits.done.wait(20)
    assert exits.codes == [EXIT_HUNG] and any("disk full" in line for line in logs)


@pytest.mark.parametrize("left", [True, False])
def test_in_a_hang_others_caused_a_rank_that_may_restart_warm_leaves_its_main_thread_to_fail(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, left: bool) -> None:
    """Rank 1 hangs and its stacks name it; rank 0 decides to restart in place. Rank 1 exits at once; rank 0,
    which may restart warm, waits for its main thread: gone from the watched work (its collective broke when rank 1
    left), rank 0's watchdog ends nothing; still there after ``warm_wait_s``, it exits as decided."""
    monkeypatch.setattr(watchdog, "suspects", lambda *_: {1: "/bench/faults.py, in maybe_inject_fault"})
    run_dir = _run_dir(tmp_path)
    exits0, exits1 = Exits(), Exits()
    logs: list[str] = []
    rank0 = Watchdog(run_dir, 0, 2, "8.0", LONG, lambda _: (EXIT_RESTART_IN_PLACE, "restarting in place"),
                     logs.append, poll_s=0.05, exit=exits0, warm_wait_s=5.0 if left else 0.5)
    rank1 = Watchdog(run_dir, 1, 2, "8.0", SHORT, None, logs.append, poll_s=0.05, exit=exits1, warm_wait_s=5.0)
    with rank1:
        rank0.__enter__()
        rank1.enter("step", 3)
        assert exits1.done.wait(20) and exits1.codes == [EXIT_RESTART_IN_PLACE]  # named: it leaves at once
        if left:
            time.sleep(0.3)
            assert exits0.codes == []  # waiting for its main thread
            rank0.leave()  # the main thread failed on its own, and lets go of its life
            rank0._thread.join(5)
            assert not rank0._thread.is_alive() and exits0.codes == []
            rank0.__exit__(None, None, None)
        else:
            assert exits0.done.wait(20) and exits0.codes == [EXIT_RESTART_IN_PLACE]
            rank0.__exit__(None, None, None)
    decision = json.loads(rank0.decision.read_text())
    assert decision["suspects"] == [1] and decision["exit_code"] == EXIT_RESTART_IN_PLACE
    assert any("rank(s) 1 leave; this rank restarts warm once its collective fails" in line for line in logs)


def _dump(main: str, frames: list[str]) -> str:
    lines = "\n".join(f'  File "{frame}", line 1 in f' for frame in frames)
    return (f"# rank 0 on n1\n# hang: x\n# main thread {main}\n"
            f"Current thread 0x00000000000000aa (most recent call first):\n  File \"watchdog.py\", line 1 in run\n\n"
            f"Thread {main} (most recent call first):\n{lines}\n")


def test_suspects_are_the_ranks_outside_a_collective(tmp_path: Path) -> None:
    run_dir = _run_dir(tmp_path)
    stacks_path(run_dir, 0).write_text(_dump("0x00000000000000bb", [
        "/venv/torch/distributed/distributed_c10d.py", "/hpc_train/train/trainer.py"]))
    stacks_path(run_dir, 1).write_text(
        _dump("0x00000000000000cc", ["/venv/torch/distributed/distributed_c10d.py"])  # an earlier dump
        + _dump("0x00000000000000cc", ["/hpc_train/data.py", "/hpc_train/train/trainer.py"]))
    found = suspects(run_dir, 3)  # rank 2 left no dump: left out
    assert list(found) == [1] and "/hpc_train/data.py" in found[1]


def test_find_straggler() -> None:
    assert find_straggler([0.015, 0.165], 1.5) == (1, pytest.approx(11.0))
    assert find_straggler([0.10, 0.11, 0.10, 0.30], 1.5) == (3, pytest.approx(3.0))
    assert find_straggler([0.10, 0.12, 0.11, 0.13], 1.5) is None
    assert find_straggler([0.001, 0.005], 1.5) is None  # 4 ms apart: noise
    assert find_straggler([0.1, 0.5], 0) is None
    assert find_straggler([0.0, 0.5], 1.5) is None


def _info(job_id: str = "42") -> LaunchInfo:
    return LaunchInfo("srun", 0, 0, 2, 1, 0, 2, "n[1-2]", job_id, "", 0)


def test_decide_hang_requeues_up_to_the_limit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SUBMITIT_EXECUTOR", "local")
    hang = Hang(1, "n2", "step", 14, 31.0, 30.0, time.time(), suspects="rank 1 in data.py")
    code, why = decide_hang(tmp_path, _info(), None, hang, RetryPolicy(max_hang=1), lambda _: None)
    assert code == LOCAL_REQUEUE_EXIT and "restarts" in why
    code, why = decide_hang(tmp_path, _info(), None, hang, RetryPolicy(max_hang=1), lambda _: None)
    assert code == EXIT_HUNG and "retry.hang = 1" in why
    attempts = AttemptLog(tmp_path).read()
    assert [(a.outcome, a.requeued) for a in attempts] == [("hang", True), ("hang", False)]
    assert "rank 1 in data.py" in attempts[0].note and attempts[0].end_step == 14
    # A new submission (another job id) starts counting again.
    code, _ = decide_hang(tmp_path, _info("43"), None, hang, RetryPolicy(max_hang=1), lambda _: None)
    assert code == LOCAL_REQUEUE_EXIT


def test_what_rank_0_raises_after_its_hang_decision_is_a_consequence(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A rank that restarts warm after a hang fails in its broken collective: on rank 0 that error must not
    rewrite the attempt the watchdog recorded as a hang."""
    monkeypatch.setenv("SUBMITIT_EXECUTOR", "local")
    logs: list[str] = []
    recorder = AttemptRecorder(tmp_path, _info(), 10, 30, logs.append)
    hang = Hang(1, "n2", "step", 14, 31.0, 30.0, time.time())
    decide_hang(tmp_path, _info(), recorder, hang, RetryPolicy(max_hang=1), lambda _: None)
    recorder.failed(14, RuntimeError("Connection closed by peer"))
    [attempt] = AttemptLog(tmp_path).read()
    assert attempt.outcome == "hang" and any("a consequence, not a failure" in line for line in logs)


def test_decide_hang_outside_a_scheduler_fails(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("SUBMITIT_EXECUTOR", "SLURM_JOB_ID"):
        monkeypatch.delenv(name, raising=False)
    hang = Hang(0, "n1", "startup", 0, 31.0, 30.0, time.time())
    code, why = decide_hang(tmp_path, _info(), None, hang, RetryPolicy(max_hang=2), lambda _: None)
    assert code == EXIT_HUNG and "not under Slurm" in why


def test_faults_fire_at_their_step_and_restart(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(faults.FAULT_VARIABLE, "raise:1")
    monkeypatch.setenv(faults.STEP_VARIABLE, "3")
    faults.maybe_inject_fault(1)  # start-up: not this fault's moment
    faults.maybe_inject_fault(1, 2)
    faults.maybe_inject_fault(0, 3)  # another rank
    with pytest.raises(RuntimeError, match="injected fault on rank 1"):
        faults.maybe_inject_fault(1, 3)
    monkeypatch.setenv(faults.RESTART_VARIABLE, "0")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    faults.maybe_inject_fault(1, 3)  # only in the first attempt
    monkeypatch.setenv(faults.FAULT_VARIABLE, "slow:1:250")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "0")
    assert faults.injected_delay_s(1) == 0.25 and faults.injected_delay_s(0) == 0.0


def test_a_slow_rank_is_named_with_its_node(tmp_path: Path) -> None:
    """A real local run: rank 1 spends 150 ms more in each forward pass; rank 0's log names it."""
    import subprocess
    import sys

    from tests.conftest import REPO

    result = subprocess.run([sys.executable, "-m", "hpc_train.submit", str(REPO / "examples" / "tiny_gpt.toml"),
                             "--site", "local", "--set", "train.steps=8", "--set", "train.warmup_steps=2",
                             "--set", "monitor.log_every=2", "--set", "monitor.eval_every=0",
                             "--set", "env.HPC_TRAIN_INJECT_FAULT=slow:1:150"],
                            cwd=tmp_path, capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    named = [line for line in result.stdout.splitlines() if "straggler at step" in line]
    assert named and all("rank 1 on " in line for line in named), result.stdout[-3000:]
