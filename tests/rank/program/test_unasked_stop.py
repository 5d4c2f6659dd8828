"""A program that never asks ``should_stop()``: after the grace period every rank leaves together, with the exit
status rank 0 published once it had requeued and recorded the attempt, whichever rank got the signal; what a
rank's program raises meanwhile is a consequence of the stop; a program that asks is left to stop by itself.

The ranks are threads here, each with its own :class:`UnaskedStop` over one run folder (the files are the only
channel between them, as between nodes); the cluster and the local executor run the same code in
tests/integrations."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from hpc_train.rank.program.stop import UnaskedStop
from hpc_train.rank.runtime.preemption import Requeue
from hpc_train.run.stops import StopConsequence, read_notice

SIGUSR2 = 12


class Recorder:
    def __init__(self) -> None:
        self.stops: list[tuple[Any, ...]] = []

    def requeue_decision(self, requeue_signal: bool, *_: Any) -> Requeue:
        return Requeue("scontrol", 0, "scontrol requeue 42") if requeue_signal else Requeue("none", 75, "SIGTERM")

    def record_stop(self, step: int | None, signum: int, decision: Requeue, why: str = "") -> Requeue:
        time.sleep(0.3)  # scontrol takes a moment: nobody may leave before it is done
        self.stops.append((step, signum, decision.action, why))
        return decision


class Rank:
    def __init__(self, run_dir: Path, rank: int, recorder: Recorder, step: int | None = None) -> None:
        self.watch = SimpleNamespace(received=0, received_at=None)
        self.asked = threading.Event()
        self.exited: tuple[int, float] | None = None
        plan = SimpleNamespace(signal="USR2", lead_seconds=60,
                               config=SimpleNamespace(preempt=SimpleNamespace(requeue=True, max_requeues=5)))
        self.lines: list[str] = []
        self.stop = UnaskedStop(plan, rank, self.watch, recorder, lambda: self.asked, lambda: step,  # type: ignore[arg-type]
                                self.lines.append, run_dir, "42.0", self._exit, poll_s=0.02, linger_s=1.5)
        self.stop.grace_s = 0.3

    def _exit(self, code: int) -> None:
        self.exited = (code, time.monotonic())


def _until(condition: Any, timeout_s: float = 15) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_every_rank_leaves_with_rank_0_s_status_after_the_requeue_whichever_rank_has_the_signal(
        tmp_path: Path) -> None:
    (tmp_path / "heartbeats").mkdir()
    recorder = Recorder()
    ranks = [Rank(tmp_path, rank, recorder) for rank in range(3)]
    for rank in ranks:
        rank.stop.__enter__()
    ranks[2].watch.received = SIGUSR2  # only the last rank's node got the signal
    _until(lambda: all(rank.exited for rank in ranks))
    assert [rank.exited[0] for rank in ranks] == [0, 0, 0]  # type: ignore[index]
    assert recorder.stops == [(None, SIGUSR2, "scontrol", "the program did not ask should_stop(); ")]
    done = read_notice(tmp_path, "42.0")
    assert done is not None and done.phase == "done" and done.step is None
    # nobody left before rank 0 had requeued and recorded; rank 0 left last, after the others
    assert all(rank.exited[1] <= ranks[0].exited[1] for rank in ranks)  # type: ignore[index]
    assert "stopped at an unknown step on SIGUSR2 (scontrol: scontrol requeue 42); exit status 0" in ranks[1].lines
    for rank in ranks:
        rank.stop.__exit__()


def test_what_a_program_raises_during_the_stop_is_a_consequence_with_the_stop_s_status(tmp_path: Path) -> None:
    (tmp_path / "heartbeats").mkdir()
    recorder = Recorder()
    ranks = [Rank(tmp_path, rank, recorder, step=45) for rank in range(2)]
    error = RuntimeError("Connection closed by peer")
    assert ranks[1].stop.consequence(error) is None  # no stop under way: the program's own failure
    for rank in ranks:
        rank.stop.__enter__()
        rank.watch.received = SIGUSR2
    _until(lambda: read_notice(tmp_path, "42.0") is not None)
    consequence = ranks[1].stop.consequence(error)
    assert isinstance(consequence, StopConsequence) and consequence.error is error
    assert consequence.notice.phase == "done" and consequence.notice.exit_code == 0
    assert consequence.notice.step == 45
    _until(lambda: all(rank.exited for rank in ranks))
    for rank in ranks:
        rank.stop.__exit__()


def test_a_program_that_asks_is_left_to_stop_by_itself(tmp_path: Path) -> None:
    recorder = Recorder()
    rank = Rank(tmp_path, 0, recorder)
    rank.asked.set()
    rank.stop.__enter__()
    rank.watch.received = SIGUSR2
    time.sleep(1.0)
    rank.stop.__exit__()
    assert rank.exited is None and recorder.stops == [] and read_notice(tmp_path, "42.0") is None
