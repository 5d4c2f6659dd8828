"""The hang watchdog: a thread per rank that ends a job making no progress, long before any collective timeout.

A hung collective or a rank stuck in I/O holds every rank of the job, and NCCL's timeout (30 minutes by default)
or the time limit would burn the allocation. Each rank's main loop tells the watchdog what phase it is in
(start-up, a step, a checkpoint); each phase has its own timeout. When one passes:

1. the rank writes a marker (``heartbeats/hang-ATTEMPT.json``); every rank's watchdog sees it within a second;
2. every rank dumps the Python stacks of all its threads into ``logs/stacks-rank-N.txt``: the rank that is not
   inside a collective is the culprit;
3. rank 0 records the attempt as ``hang`` and decides (``[retry] hang``): requeue, or fail;
4. every rank exits with the status rank 0 chose (:data:`EXIT_HUNG` unless it requeues on the local executor),
   except, when the ranks restart in place, a rank the stacks do not name and that may restart warm
   (``warm_wait_s``): it waits in a collective on the named ranks, whose exit breaks that collective, and its main
   thread then fails as on a peer's death and trains the next life in the same process (:mod:`hpc_train.rank.entry`).
   It exits after ``warm_wait_s`` only if its main thread has not left by then.

The thread never touches torch: it must keep running while the main thread is stuck inside a collective. It
writes nothing while the rank makes progress (no heartbeat files: on a shared file system every rank's periodic
write is a metadata operation, and nothing read them).
"""

from __future__ import annotations

import contextlib
import dataclasses
import faulthandler
import json
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from hpc_train.control.events import hang_decision_key, hang_key, rank_events
from hpc_train.run.exit_codes import EXIT_HUNG, EXIT_RESTART_IN_PLACE
from hpc_train.run.files import atomic_write
from hpc_train.run.loglines import format_not_in_collective
from hpc_train.run.node import node_name
from hpc_train.run.paths import (
    FLIGHT_RECORDER_DIR,
    HEARTBEAT_DIR,
    hang_decision_path,
    hang_marker_path,
    stacks_path,
)
from hpc_train.run.stacks import COLLECTIVE_FRAMES, DUMP_SEPARATOR, main_thread_frames

__all__ = ["THREAD_NAME", "Decision", "Hang", "Timeouts", "Watchdog", "suspects"]

THREAD_NAME = "hpc_train-watchdog"

_DECISION_FILE_EVERY_S = 10.0  # per rank, while every rank waits for rank 0's hang decision
PHASES = ("startup", "step", "checkpoint")


def suspects(run_dir: Path, world_size: int, hang_id: float | None = None) -> dict[int, str]:
    """Ranks whose main thread is not waiting in a collective, with the frame it is in: in a hang, every other
    rank waits for these. Reads each ``stacks-rank-N.txt``'s dump of hang ``hang_id`` (else its last dump); ranks
    without one are left out. On NCCL a waiting rank may sit in ``.item()`` rather than torch.distributed, so
    this names more ranks than it should there; the flight recorder (``logs/nccl-trace/``) tells them apart."""
    found: dict[int, str] = {}
    for rank in range(world_size):
        try:
            text = stacks_path(run_dir, rank).read_text(encoding="utf-8", errors="replace")
        except OSError:
            continue
        dumps = text.split(DUMP_SEPARATOR)
        if hang_id is not None:
            dumps = [d for d in dumps if f"# hang-id {hang_id!r}" in d]
            if not dumps:
                continue
        frames = main_thread_frames(dumps[-1])
        if frames and not any(marker in frame for frame in frames for marker in COLLECTIVE_FRAMES):
            found[rank] = frames[0].removeprefix("File ")
    return found


@dataclass(frozen=True)
class Timeouts:
    """Seconds without progress each phase allows (``[watchdog]``)."""

    startup: float
    step: float
    checkpoint: float

    def of(self, phase: str) -> float:
        return float(getattr(self, phase))


@dataclass(frozen=True)
class Hang:
    """What the first rank to notice saw: the rank, its host, the phase, the step and how long it waited."""

    rank: int
    host: str
    phase: str
    step: int
    waited_s: float
    timeout_s: float
    time: float
    suspects: str = ""

    def describe(self) -> str:
        text = (f"no progress for {self.waited_s:.0f} s in {self.phase} after step {self.step}, noticed by rank "
                f"{self.rank} ({self.host}) (watchdog.{self.phase}_timeout_s = {self.timeout_s:.0f})")
        return text + (f"; not in a collective: {self.suspects}" if self.suspects else "")


# What rank 0 does about a hang: returns the exit status every rank leaves with, and why.
Decide = Callable[[Hang], "tuple[int, str]"]


@dataclass(frozen=True)
class Decision:
    """Rank 0's decision on a hang, as every rank reads it: the status to leave with, why, and the ranks the
    stacks name as outside a collective (empty where they cannot tell)."""

    exit_code: int
    reason: str
    suspects: tuple[int, ...] = ()


class Watchdog:
    """Use as a context manager around a rank's work; call :meth:`enter` at each phase change (and each step)."""

    def __init__(self, run_dir: Path, rank: int, world_size: int, attempt: str, timeouts: Timeouts,
                 decide: Decide | None, log: Callable[[str], None], *, poll_s: float = 1.0,
                 grace_s: float = 90.0, exit: Callable[[int], None] = os._exit, warm_wait_s: float = 0.0) -> None:
        self.run_dir, self.rank, self.world_size, self.timeouts = run_dir, rank, world_size, timeouts
        self.decide, self.log = decide, log
        self.poll_s = poll_s
        self.grace_s = grace_s  # rank 0 may wait 10 s for the dumps and 60 s for scontrol: others wait longer
        self.warm_wait_s = warm_wait_s  # how long a rank the stacks do not name leaves its main thread to fail
        self._exit = exit
        self.host = node_name()  # Slurm's name: what the hang's record and --exclude name
        self.attempt = attempt
        self.marker = hang_marker_path(run_dir, attempt)
        self.decision = hang_decision_path(run_dir, attempt)
        # A restart of the local executor reuses the attempt's name: anything older than this start is history.
        self.started = time.time()
        self._progress = ("startup", 0, time.monotonic())  # one tuple: the thread never pairs a phase with a
        self._stop = threading.Event()                     # time from another
        self._left = threading.Event()  # the main thread is on its way out of the watched work (a failure)
        self._thread = threading.Thread(target=self._run, name=THREAD_NAME, daemon=True)
        self.fired: Hang | None = None

    def __enter__(self) -> Watchdog:
        (self.run_dir / HEARTBEAT_DIR).mkdir(mode=0o700, exist_ok=True)
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._left.set()
        self._stop.set()
        self._thread.join(timeout=5)

    def leave(self) -> None:
        """The main thread failed and is letting go of its work: a watchdog that waits for it to restart warm
        (:meth:`_left_on_its_own`) stands down now rather than ending the process in the middle of the release.
        Otherwise it goes on watching until ``__exit__``."""
        self._left.set()

    @property
    def phase(self) -> str:
        return self._progress[0]

    @property
    def step(self) -> int:
        return self._progress[1]

    def enter(self, phase: str, step: int | None = None) -> None:
        """Progress: the rank starts ``phase`` now (one attribute write: safe from the main thread)."""
        self._progress = (phase, self._progress[1] if step is None else step, time.monotonic())

    # --- the thread ------------------------------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            phase, step, since = self._progress
            now = time.monotonic()
            timeout = self.timeouts.of(phase)
            if now - since > timeout:  # before any file I/O, which a stuck file system could block
                self._on_hang(Hang(self.rank, self.host, phase, step, now - since, timeout, time.time()),
                              first=True)
                return
            seen = self._current_marker()
            if seen is not None:
                self._on_hang(seen, first=False)
                return

    def _current_marker(self) -> Hang | None:
        """This attempt's marker, once it is complete: as the job's coordinator pushed it where the agent named
        one (no file read in this once-a-second check), else the run folder's file."""
        events = rank_events()
        if events is not None:
            return self._fresh(events.seen(hang_key(self.attempt)))
        return self._marker_file()

    def _marker_file(self) -> Hang | None:
        """The marker file: written whole (link of a full file), so never read half."""
        try:
            return self._fresh(json.loads(self.marker.read_text(encoding="utf-8")))
        except (OSError, ValueError):
            return None

    def _fresh(self, data: object) -> Hang | None:
        """``data`` as a hang of this run: one from before this watchdog started belongs to an earlier run of
        the same attempt name."""
        try:
            hang = Hang(**data)  # type: ignore[arg-type]
        except TypeError:
            return None
        return hang if hang.time >= self.started - 1 else None

    def _claim_marker(self, hang: Hang) -> Hang:
        """The first rank to notice publishes the marker; a later one takes what the first saw. The run folder
        keeps the record; the coordinator, where there is one, says which hang holds and tells every rank."""
        held = self._claim_marker_file(hang)
        events = rank_events()
        if events is not None:
            return self._fresh(events.set(hang_key(self.attempt), asdict(held), first=True)) or held
        return held

    def _claim_marker_file(self, hang: Hang) -> Hang:
        """The file is written under a private name and linked into place, so no rank ever reads half of it."""
        private = self.marker.with_name(f"{self.marker.name}.{self.rank}.{os.getpid()}")
        private.write_text(json.dumps(asdict(hang)) + "\n", encoding="utf-8")
        try:
            os.link(private, self.marker)
        except FileExistsError:
            earlier = self._marker_file()
            if earlier is not None:
                return earlier
            os.replace(private, self.marker)  # a stale marker of an earlier run: this hang replaces it
            return hang
        finally:
            private.unlink(missing_ok=True)
        return hang

    def _dump_stacks(self, hang: Hang) -> None:
        path = stacks_path(self.run_dir, self.rank)
        phase, step, since = self._progress
        with open(path, "a", encoding="utf-8") as out:
            out.write(f"# rank {self.rank} on {self.host}, pid {os.getpid()}, {time.strftime('%Y-%m-%d %H:%M:%S')}: "
                      f"phase {phase}, step {step}, {time.monotonic() - since:.0f} s since progress\n"
                      f"# hang: {hang.describe()}\n# hang-id {hang.time!r}\n"
                      f"# main thread 0x{threading.main_thread().ident or 0:016x}\n")
            out.flush()
            faulthandler.dump_traceback(file=out, all_threads=True)
            out.write("\n")
        _dump_flight_recorder(self.run_dir, self.rank)

    def _on_hang(self, seen: Hang, first: bool) -> None:
        """Whatever goes wrong in here, the rank exits (a watchdog that died would leave the job hanging), unless
        its main thread left the watched work on its own to restart warm (:meth:`_left_on_its_own`)."""
        decided = Decision(EXIT_HUNG, "the watchdog failed while handling the hang")
        try:
            hang = self._claim_marker(seen) if first else seen
            self.fired = hang
            self._dump_stacks(hang)
            self.log(f"hang: {hang.describe()}; stacks of every thread in {stacks_path(self.run_dir, self.rank)}")
            decided = self._decide(hang) if self.rank == 0 else self._wait_for_decision(hang)
            if self._left_on_its_own(decided):
                return
        except BaseException as error:  # logged; the exit below still happens
            self.log(f"hang: the watchdog failed while handling it: {error!r}")
        self.log(f"hang: exiting with status {decided.exit_code}: {decided.reason}")
        self._exit(decided.exit_code)

    def _left_on_its_own(self, decided: Decision) -> bool:
        """When the ranks restart in place and the stacks name other ranks than this one: those leave now, which
        breaks this rank's collective, and its main thread restarts warm. True once it has failed (:meth:`leave`)
        within ``warm_wait_s``; False where this rank should exit as decided. (If its release then never ends, the
        agent, which waits only so long for a warm rank, ends the process.)"""
        if decided.exit_code != EXIT_RESTART_IN_PLACE or not decided.suspects or self.rank in decided.suspects \
                or self.warm_wait_s <= 0:
            return False
        named = ", ".join(str(rank) for rank in decided.suspects)
        self.log(f"hang: rank(s) {named} leave; this rank restarts warm once its collective fails (up to "
                 f"{self.warm_wait_s:.0f} s)")
        return self._left.wait(self.warm_wait_s)

    def _decide(self, hang: Hang) -> Decision:
        self._wait_for_stacks(hang)
        culprits = suspects(self.run_dir, self.world_size, hang.time)
        for rank, frame in culprits.items():
            self.log(format_not_in_collective(rank, frame))
        named: list[int] = []
        if culprits and len(culprits) < self.world_size:  # every rank "outside": the dumps cannot tell (NCCL)
            where = "; ".join(f"rank {rank} in {frame}" for rank, frame in culprits.items())
            hang = dataclasses.replace(hang, suspects=where)
            named = sorted(culprits)
        code, why = self.decide(hang) if self.decide is not None else (EXIT_HUNG, "no decision")
        decision = {"hang": hang.time, "exit_code": code, "reason": why, "suspects": named}
        atomic_write(self.decision, json.dumps(decision) + "\n")  # the record; the coordinator tells the ranks
        events = rank_events()
        if events is not None:
            events.set(hang_decision_key(self.attempt), decision)
        return Decision(code, why, tuple(named))

    def _wait_for_stacks(self, hang: Hang, wait_s: float = 10.0) -> None:
        """Give every rank's watchdog a moment to see the marker and dump this hang (they poll every second).
        A rank's dump once found is not read again: each look reads only the ranks still missing."""
        deadline = time.monotonic() + wait_s
        token = f"# hang-id {hang.time!r}"
        missing = list(range(self.world_size))
        while time.monotonic() < deadline:
            missing = [r for r in missing if not _has_dump(stacks_path(self.run_dir, r), token)]
            if not missing:
                return
            time.sleep(0.2)

    def _wait_for_decision(self, hang: Hang) -> Decision:
        """Other ranks leave only after rank 0 has recorded and requeued: an early exit would break rank 0's
        collective and turn the hang into an ordinary failure. The decision is pushed by the job's coordinator
        where there is one (no file read by 16,384 ranks five times a second), else read from the run folder."""
        deadline = time.monotonic() + self.grace_s
        file_due = 0.0
        while time.monotonic() < deadline:
            with_file = time.monotonic() >= file_due  # the record too, every 10 s: rank 0 may have lost its push
            if with_file:
                file_due = time.monotonic() + _DECISION_FILE_EVERY_S
            decided = self._decision_for(hang, with_file)
            if decided is not None:
                return decided
            time.sleep(0.2)
        return Decision(EXIT_HUNG, f"rank 0 decided nothing within {self.grace_s:.0f} s")

    def _decision_for(self, hang: Hang, with_file: bool = True) -> Decision | None:
        """Rank 0's decision on ``hang``: from the coordinator's push, and with ``with_file`` (or without a
        coordinator) from the run folder's record too."""
        events = rank_events()
        if events is not None:
            decided = _decision_of(events.seen(hang_decision_key(self.attempt)), hang)
            if decided is not None or not with_file:
                return decided
        try:
            return _decision_of(json.loads(self.decision.read_text(encoding="utf-8")), hang)
        except (OSError, ValueError):
            return None


def _decision_of(data: Any, hang: Hang) -> Decision | None:
    """Rank 0's decision, when ``data`` is its decision on ``hang``."""
    try:
        if data.get("hang") == hang.time:
            return Decision(int(data["exit_code"]), str(data["reason"]),
                            tuple(int(rank) for rank in data.get("suspects", ())))
    except (AttributeError, KeyError, TypeError, ValueError):
        pass
    return None


def _has_dump(path: Path, token: str) -> bool:
    try:
        return token in path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return False


def _dump_flight_recorder(run_dir: Path, rank: int) -> None:
    """On NCCL, also write torch's flight recorder (the last collectives) where its own timeout would: the
    watchdog ends the rank before NCCL's timeout fires. Best effort: absent on CPU builds and older torch."""
    torch = sys.modules.get("torch")
    dump = getattr(getattr(getattr(torch, "_C", None), "_distributed_c10d", None), "_dump_nccl_trace", None)
    if dump is None or not os.environ.get("TORCH_NCCL_TRACE_BUFFER_SIZE"):
        return
    with contextlib.suppress(Exception):
        (run_dir / FLIGHT_RECORDER_DIR).mkdir(exist_ok=True)
        (run_dir / FLIGHT_RECORDER_DIR / f"rank-{rank}").write_bytes(dump())
