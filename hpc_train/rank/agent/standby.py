"""Standby ranks: processes a node's agent keeps ready with torch and the rank's modules imported, so that a rank
of the next life starts without paying its imports again (``retry.standby``).

A rank's start is mostly imports (about 4.4 s of 4.9 s for the tiny GPT on a CPU, ``docs/performance.md``),
paid again by every rank at every restart in place. Each life, once its ranks have had ``START_GRACE_S`` to start
(their own imports would compete for the node's CPUs with the standbys'), the agent starts one standby per rank of
its node (:mod:`hpc_train.rank.agent.standby_main`). When it next starts a rank, it hands a standby the rank's
command and environment over a pipe, and the standby becomes the rank. A standby is used only where the rank's
environment differs from the one it was started with in the rank's own place (``SLURM_*``, ``HPC_TRAIN_*``),
never in what a library reads when it is imported (``OMP_NUM_THREADS``, ``CUDA_VISIBLE_DEVICES``, ``LD_*``);
otherwise, and where none is ready or one has died, the rank starts cold as before.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from typing import Any

from hpc_train.run.procs import parent_death_signal

__all__ = ["START_GRACE_S", "StandbyPool"]

START_GRACE_S = 10.0  # a life's ranks import first; the standbys for the next life start after them
_PLACE = ("SLURM_", "HPC_TRAIN_")  # what may differ between a standby's environment and its rank's


def _differs(rank_env: Mapping[str, str], standby_env: Mapping[str, str]) -> list[str]:
    """The variables that differ between the two environments and that a rank may not change after its imports."""
    names = {name for name in {*rank_env, *standby_env} if rank_env.get(name) != standby_env.get(name)}
    return sorted(name for name in names if not name.startswith(_PLACE))


class StandbyPool:
    """One node's standby ranks: started :meth:`refill` each life, taken by :meth:`start` for the next."""

    def __init__(self, kind: str, count: int, env: Mapping[str, str], log: Callable[[str], None],
                 python: str = sys.executable) -> None:
        self.kind, self.count, self.env, self.log, self.python = kind, count, dict(env), log, python
        self._ready: list[subprocess.Popen[bytes]] = []
        self._signals: dict[int, int] = {}  # standby pid: the read end of the pipe it says it is ready on
        self._started = 0.0  # when the last standbys were started (monotonic), for the line saying they are ready
        self._due: float | None = None  # when to start the next life's standbys (monotonic)
        self._said_cold = False
        self.used = 0  # ranks a standby became since the last life began

    @property
    def pids(self) -> set[int]:
        return {standby.pid for standby in self._ready}

    def schedule(self) -> None:
        """A life has just started its ranks: its standbys start once those have had their start."""
        self._due = time.monotonic() + START_GRACE_S
        if self.used:
            self.log(f"{self.used} rank(s) of this node started from standby processes (imports done)")
        self.used = 0

    def tick(self) -> None:
        """Called on the agent's poll: start the standbys when they are due; say once when all are ready."""
        if self._due is not None and time.monotonic() >= self._due:
            self._due = None
            self.refill()
        if not self._signals:
            return
        for pid, ready in list(self._signals.items()):
            if select.select([ready], [], [], 0)[0]:  # a byte, or the end of a standby that died
                os.close(ready)
                del self._signals[pid]
                if not self._signals:
                    alive = sum(standby.poll() is None for standby in self._ready)
                    self.log(f"{alive} standby rank(s) ready for the next life (imports done in "
                             f"{time.monotonic() - self._started:.1f} s)")

    def refill(self) -> None:
        """Start standbys until ``count`` are alive (one that died, a signal from Slurm, is replaced)."""
        self._ready = [standby for standby in self._ready if standby.poll() is None]
        self._started = time.monotonic()
        while len(self._ready) < self.count:
            ready, tell = os.pipe()
            try:
                self._ready.append(subprocess.Popen(
                    [self.python, "-u", "-m", "hpc_train.rank.agent.standby_main", self.kind, str(tell)],
                    env=self.env, stdin=subprocess.PIPE, pass_fds=(tell,), preexec_fn=parent_death_signal()))
            except OSError as error:  # out of processes or memory: the ranks start cold, as without standbys
                os.close(ready)
                self.log(f"standby ranks: could not start one ({error}); the next life's ranks start cold")
                return
            finally:
                os.close(tell)
            self._signals[self._ready[-1].pid] = ready

    def start(self, argv: list[str], env: Mapping[str, str], cpus: set[int] | None = None
              ) -> subprocess.Popen[bytes]:
        """The rank ``argv`` with ``env`` (and its share ``cpus`` of the node's, which a standby gives every thread
        it has before it becomes the rank): a standby made that rank, or a new process where none fits."""
        why = self._unfit(argv, env)
        order = json.dumps({"argv": argv, "env": dict(env), "cpus": sorted(cpus or ())}).encode() + b"\n"
        while not why and self._ready:
            standby = self._ready.pop(0)
            with contextlib.suppress(KeyError, OSError):
                os.close(self._signals.pop(standby.pid))  # taken, ready or not: the rank's start is its own now
            if standby.poll() is not None or standby.stdin is None:
                continue
            try:
                standby.stdin.write(order)
                standby.stdin.close()
            except OSError:  # it died between the look and the write
                self._kill(standby)
                continue
            self.used += 1
            return standby
        if why and not self._said_cold:
            self._said_cold = True
            self.log(f"standby ranks: not used, the ranks start cold: {why}")
        return subprocess.Popen(argv, env=dict(env))

    def _unfit(self, argv: list[str], env: Mapping[str, str]) -> str:
        if "-m" not in argv[:-1] or argv[0] != self.python:
            return f"the rank command {argv[:4]} is not this interpreter's -m MODULE"
        differs = _differs(env, self.env)
        if differs:
            return f"the rank's environment differs from the standby's in {', '.join(differs[:5])}"
        return ""

    def close(self) -> None:
        """End every standby (the agent leaves, or the job ends)."""
        for standby in self._ready:
            self._kill(standby)
        for ready in self._signals.values():
            os.close(ready)
        self._ready, self._signals, self._due = [], {}, None

    @staticmethod
    def _kill(standby: subprocess.Popen[Any]) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(standby.pid, signal.SIGKILL)
        with contextlib.suppress(OSError):
            if standby.stdin is not None:
                standby.stdin.close()
        standby.wait()
