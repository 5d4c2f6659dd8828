"""The hang watchdog: a thread per rank that ends a job making no progress, long before any collective timeout.

A hung collective or a rank stuck in I/O holds every rank of the job, and NCCL's timeout (30 minutes by default)
or the time limit would burn the allocation. Each rank's main loop tells the watchdog what phase it is in
(start-up, a step, a checkpoint); each phase has its own timeout. When one passes:

1. the rank writes a marker (``heartbeats/hang-ATTEMPT.json``); every rank's watchdog sees it within a second;
2. every rank dumps the Python stacks of all its threads into ``logs/stacks-rank-N.txt``: the rank that is not
   inside a collective is the culprit;
3. rank 0 records the attempt as ``hang`` and decides (``[retry] hang``): requeue, or fail;
4. every rank exits with the status rank 0 chose (:data:`EXIT_HUNG` unless it requeues on the local executor).

The thread also writes ``heartbeats/rank-N.json`` every few seconds (phase, step, age) for ``status``. It never
touches torch: it must keep running while the main thread is stuck inside a collective.
"""

from __future__ import annotations

import contextlib
import dataclasses
import faulthandler
import json
import os
import re
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from hpc_train.runfolder import atomic_write

__all__ = ["EXIT_HUNG", "HEARTBEAT_DIR", "Hang", "Timeouts", "Watchdog", "stacks_path", "suspects"]

EXIT_HUNG = 77  # the watchdog ended a rank that made no progress; the stacks are in logs/stacks-rank-N.txt
HEARTBEAT_DIR = "heartbeats"
PHASES = ("startup", "step", "checkpoint")


COLLECTIVE_FRAMES = ("torch/distributed/", "deepspeed/comm/", "deepspeed/runtime/comm/")


def stacks_path(run_dir: Path, rank: int) -> Path:
    return run_dir / "logs" / f"stacks-rank-{rank}.txt"


def _main_thread_frames(dump: str) -> list[str]:
    """The frames of the rank's main thread (named in the dump's header), innermost first."""
    match = re.search(r"^# main thread (0x[0-9a-f]+)$", dump, re.MULTILINE)
    if match is None:
        return []
    frames: list[str] = []
    inside = False
    for line in dump.splitlines():
        if line.startswith(("Thread 0x", "Current thread 0x")):
            inside = match[1] in line.split()
            continue
        if inside and line.strip().startswith("File"):
            frames.append(line.strip())
    return frames


def suspects(run_dir: Path, world_size: int) -> dict[int, str]:
    """Ranks whose main thread is not waiting in a collective, with the frame it is in: in a hang, every other
    rank waits for these. Reads the last dump of each ``stacks-rank-N.txt``; ranks without one are left out."""
    found: dict[int, str] = {}
    for rank in range(world_size):
        try:
            text = stacks_path(run_dir, rank).read_text(encoding="utf-8", errors="replace")
        except OSError:
            continue
        frames = _main_thread_frames(text.rsplit("\n# rank ", 1)[-1])
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


class Watchdog:
    """Use as a context manager around a rank's work; call :meth:`enter` at each phase change (and each step)."""

    def __init__(self, run_dir: Path, rank: int, world_size: int, attempt: str, timeouts: Timeouts,
                 decide: Decide | None, log: Callable[[str], None], *, poll_s: float = 1.0,
                 heartbeat_s: float = 10.0, grace_s: float = 30.0, exit: Callable[[int], None] = os._exit) -> None:
        self.run_dir, self.rank, self.world_size, self.timeouts = run_dir, rank, world_size, timeouts
        self.decide, self.log = decide, log
        self.poll_s, self.heartbeat_s, self.grace_s = poll_s, heartbeat_s, grace_s
        self._exit = exit
        self.host = socket.gethostname()
        folder = run_dir / HEARTBEAT_DIR
        self.marker = folder / f"hang-{attempt}.json"
        self.decision = folder / f"hang-{attempt}.decided.json"
        self.heartbeat = folder / f"rank-{rank}.json"
        self.phase, self.step, self.since = "startup", 0, time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hpc_train-watchdog", daemon=True)
        self.fired: Hang | None = None

    def __enter__(self) -> Watchdog:
        (self.run_dir / HEARTBEAT_DIR).mkdir(mode=0o700, exist_ok=True)
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def enter(self, phase: str, step: int | None = None) -> None:
        """Progress: the rank starts ``phase`` now (plain attribute writes: safe from the main thread)."""
        self.since = time.monotonic()
        self.phase = phase
        if step is not None:
            self.step = step

    # --- the thread ------------------------------------------------------------------------------------------

    def _run(self) -> None:
        last_beat = 0.0
        while not self._stop.wait(self.poll_s):
            now = time.monotonic()
            if now - last_beat >= self.heartbeat_s:
                last_beat = now
                self._write_heartbeat(now)
            waited = now - self.since
            timeout = self.timeouts.of(self.phase)
            if waited > timeout:
                self._on_hang(Hang(self.rank, self.host, self.phase, self.step, waited, timeout, time.time()),
                              first=True)
                return
            if self.marker.exists():
                self._on_hang(self._read_marker(), first=False)
                return

    def _write_heartbeat(self, now: float) -> None:
        beat = {"rank": self.rank, "host": self.host, "pid": os.getpid(), "phase": self.phase, "step": self.step,
                "since_progress_s": round(now - self.since, 1), "time": time.time()}
        with contextlib.suppress(OSError):  # a full or flaky file system must not take the watchdog down
            atomic_write(self.heartbeat, json.dumps(beat) + "\n")

    def _read_marker(self) -> Hang:
        try:
            return Hang(**json.loads(self.marker.read_text(encoding="utf-8")))
        except (OSError, ValueError, TypeError):
            return Hang(-1, "?", "?", 0, 0.0, 0.0, time.time())

    def _claim_marker(self, hang: Hang) -> Hang:
        """The first rank to notice writes the marker; a later one reads what the first saw."""
        try:
            fd = os.open(self.marker, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            return self._read_marker()
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            out.write(json.dumps(asdict(hang)) + "\n")
        return hang

    def _dump_stacks(self, hang: Hang) -> None:
        path = stacks_path(self.run_dir, self.rank)
        with open(path, "a", encoding="utf-8") as out:
            out.write(f"# rank {self.rank} on {self.host}, pid {os.getpid()}, {time.strftime('%Y-%m-%d %H:%M:%S')}: "
                      f"phase {self.phase}, step {self.step}, {time.monotonic() - self.since:.0f} s since progress\n"
                      f"# hang: {hang.describe()}\n# main thread 0x{threading.main_thread().ident or 0:016x}\n")
            out.flush()
            faulthandler.dump_traceback(file=out, all_threads=True)
            out.write("\n")

    def _on_hang(self, seen: Hang, first: bool) -> None:
        hang = self._claim_marker(seen) if first else seen
        self.fired = hang
        self._dump_stacks(hang)
        self.log(f"hang: {hang.describe()}; stacks of every thread in {stacks_path(self.run_dir, self.rank)}")
        if self.rank == 0:
            self._wait_for_stacks()
            culprits = suspects(self.run_dir, self.world_size)
            for rank, frame in culprits.items():
                self.log(f"hang: rank {rank} is not in a collective: {frame}")
            if culprits:
                where = "; ".join(f"rank {rank} in {frame}" for rank, frame in culprits.items())
                hang = dataclasses.replace(hang, suspects=where)
            code, why = self.decide(hang) if self.decide is not None else (EXIT_HUNG, "no decision")
            atomic_write(self.decision, json.dumps({"exit_code": code, "reason": why}) + "\n")
        else:
            code, why = self._wait_for_decision()
        self.log(f"hang: exiting with status {code}: {why}")
        self._exit(code)

    def _wait_for_stacks(self, wait_s: float = 10.0) -> None:
        """Give every rank's watchdog a moment to see the marker and dump (they poll every second)."""
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            if all(stacks_path(self.run_dir, r).exists() for r in range(self.world_size)):
                return
            time.sleep(0.2)

    def _wait_for_decision(self) -> tuple[int, str]:
        """Other ranks leave only after rank 0 has recorded and requeued: an early exit would break rank 0's
        collective and turn the hang into an ordinary failure."""
        deadline = time.monotonic() + self.grace_s
        while time.monotonic() < deadline:
            try:
                data = json.loads(self.decision.read_text(encoding="utf-8"))
                return int(data["exit_code"]), str(data["reason"])
            except (OSError, ValueError, KeyError, TypeError):
                time.sleep(0.2)
        return EXIT_HUNG, f"rank 0 decided nothing within {self.grace_s:.0f} s"
