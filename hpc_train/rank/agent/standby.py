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
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from typing import Any

from hpc_train.rank.agent.rejoin import REJOIN_ENV, RankProcess, order_line

__all__ = ["START_GRACE_S", "StandbyPool"]

START_GRACE_S = 10.0  # a life's ranks import first; the standbys for the next life start after them
# how long a restart waits for the ranks that outlive the failure to say so (StandbyPool.await_warm)
WARM_FIRST_S, WARM_SHORT_S, WARM_QUIET_S, WARM_MOST_S = 2.0, 0.3, 0.3, 3.0
# after a hang: its other ranks fail only once the hung ones left, then release their life (the rank's own
# watchdog gives that 10 s: rank/train/trainer.py WARM_HANG_WAIT_S), so the first and all are waited for this long
WARM_HANG_S = 12.0
_PLACE = ("SLURM_", "HPC_TRAIN_")  # what may differ between a standby's environment and its rank's


def _differs(rank_env: Mapping[str, str], standby_env: Mapping[str, str]) -> list[str]:
    """The variables that differ between the two environments and that a rank may not change after its imports."""
    names = {name for name in {*rank_env, *standby_env} if rank_env.get(name) != standby_env.get(name)}
    return sorted(name for name in names if not name.startswith(_PLACE))


class StandbyPool:
    """One node's standby ranks: started :meth:`refill` each life, taken by :meth:`start` for the next."""

    def __init__(self, kind: str, count: int, env: Mapping[str, str], log: Callable[[str], None],
                 python: str = sys.executable, rejoin: bool = True) -> None:
        self.kind, self.count, self.env, self.log, self.python = kind, count, dict(env), log, python
        self.rejoin = rejoin  # the ranks may train a later life in their own process (rejoin.trains_warm)
        self._ready: list[subprocess.Popen[bytes]] = []
        self._signals: dict[int, int] = {}  # standby pid: the read end of the pipe it says it is ready on
        self._done: set[int] = set()  # the pipes on which a standby said it is ready (or ended)
        self._said_ready = False
        self._started = 0.0  # when the last standbys were started (monotonic), for the line saying they are ready
        self._due: float | None = None  # when to start the next life's standbys (monotonic)
        self._said_cold = False
        self.used = 0  # ranks a standby became since the last life began
        self._killed: set[int] = set()  # idle standbys that died of SIGKILL (the OOM killer's first choice)
        # the trainer's ranks, which may outlive a life (rank/agent/rejoin.py): the last life's and the next's
        self._current: dict[int, RankProcess] = {}
        self._starting: dict[int, RankProcess] = {}
        self.rejoined = 0  # ranks that trained the next life in their own process since the last life began

    @property
    def pids(self) -> set[int]:
        """The standbys' and the warm ranks' processes: what the agent keeps when it ends a life's processes."""
        warm = [rank for rank in (*self._current.values(), *self._starting.values()) if rank.poll() is not None
                and rank.warm]
        return {standby.pid for standby in self._ready} | {rank.pid for rank in warm}

    @property
    def offers_rejoin(self) -> bool:
        """Whether this node's ranks get a channel to train the next life in their own process: the trainer's, where
        its ranks may (:func:`~hpc_train.rank.agent.rejoin.trains_warm`)."""
        return self.rejoin and self.kind == "train" and self.count > 0

    def schedule(self) -> None:
        """A life has just started its ranks: its standbys start once those have had their start."""
        self._due = time.monotonic() + START_GRACE_S
        if self.rejoined:
            self.log(f"{self.rejoined} rank(s) of this node restarted warm, in their own process (imports, "
                     f"compiled code and device kept)")
        if self.used:
            self.log(f"{self.used} rank(s) of this node started from standby processes (imports done)")
        self.used = self.rejoined = 0
        for left in self._current.values():  # warm ranks this life did not take (a smaller size, a spare's)
            left.close()
        self._current, self._starting = self._starting, {}

    def tick(self) -> None:
        """Called on the agent's poll: start the standbys when they are due; say once when all are ready."""
        self._safely(self._tick)

    def refill(self) -> None:
        """Start standbys until ``count`` are alive (one that died, a signal from Slurm, is replaced)."""
        self._safely(self._refill)

    def start(self, argv: list[str], env: Mapping[str, str], cpus: set[int] | None = None, rank: int | None = None
              ) -> subprocess.Popen[bytes] | RankProcess:
        """The rank ``argv`` with ``env`` (and its share ``cpus`` of the node's, which a standby gives every thread
        it has before it becomes the rank): the last life's process of ``rank`` where it stayed warm, else a ready
        standby made that rank, else a new process."""
        taken: list[subprocess.Popen[bytes] | RankProcess] = []
        self._safely(lambda: taken.extend(self._take(argv, env, cpus, rank)))
        started = taken[0] if taken else self._cold(argv, env)
        if isinstance(started, RankProcess) and rank is not None:
            self._starting[rank] = started
        return started

    def _cold(self, argv: list[str], env: Mapping[str, str]) -> subprocess.Popen[bytes] | RankProcess:
        """A new process for the rank; with the channel (:attr:`offers_rejoin`) on its standard input and a pipe."""
        if not self.offers_rejoin:
            return subprocess.Popen(argv, env=dict(env))
        warm, tell = os.pipe()
        try:
            process = subprocess.Popen(argv, env={**env, REJOIN_ENV: f"0,{tell}"}, stdin=subprocess.PIPE,
                                       pass_fds=(tell,))
        except BaseException:
            os.close(warm)
            raise
        finally:
            os.close(tell)
        if process.stdin is None:  # stdin=PIPE always gives one; without it the rank simply never restarts warm
            os.close(warm)
            return process
        return RankProcess(process, process.stdin, warm)

    def _safely(self, action: Callable[[], None]) -> None:
        """The pool's own failure never ends a life: it is said once, the pool closes, the ranks start cold."""
        try:
            action()
        except Exception as error:  # whatever it is, the ranks go on without standbys
            self.log(f"standby ranks: turned off for this job ({type(error).__name__}: {error}); ranks start cold")
            with contextlib.suppress(Exception):
                self.close(ranks=False)
            self.count = 0

    def _tick(self) -> None:
        if self._due is not None and time.monotonic() >= self._due:
            self._due = None
            self._refill()
        waiting = [pid for pid, ready in self._signals.items() if not self._has_said(ready)]
        if waiting or not self._signals or self._said_ready:
            return
        self._said_ready = True
        alive = sum(standby.poll() is None for standby in self._ready)
        self.log(f"{alive} standby rank(s) ready for the next life (imports done in "
                 f"{time.monotonic() - self._started:.1f} s)")

    def _has_said(self, ready: int) -> bool:
        """Whether the standby on the pipe ``ready`` said it is ready (or ended). Non-blocking reads, not select:
        node 0's agent also holds the coordinator's sockets, and its descriptors pass 1023 beyond 1,000 nodes."""
        if ready in self._done:
            return True
        try:
            os.read(ready, 1)
        except BlockingIOError:
            return False
        self._done.add(ready)
        return True

    def await_warm(self, children: Mapping[int, Any], ended: dict[int, int], patient: bool = False) -> None:
        """Before a restart ends a life's ranks: the trainer's ranks still running may say they are warm (their
        collective saw the failure: rank/agent/rejoin.py). A rank in a collective with the dead one says so within
        milliseconds, usually before its agent has decided; one busy computing says so at its next collective.
        The agent waits for the first to say so or end up to ``WARM_FIRST_S`` (only ``WARM_SHORT_S`` where a ready
        standby could take each rank at once instead), then while more come, up to ``WARM_QUIET_S`` after the last,
        ``WARM_MOST_S`` in all; ``patient`` (a hang, whose ranks can say so only once the hung ones left):
        ``WARM_HANG_S`` for the first and in all. The rest are killed, as before (gloo cannot break a wait on a
        peer that is itself waiting, nor NCCL without its watchdog)."""
        waiting = {rank: child for rank, child in children.items()
                   if rank not in ended and isinstance(child, RankProcess)}
        started = last = time.monotonic()
        quiet = WARM_HANG_S if patient else WARM_SHORT_S if self._ready_count() >= len(waiting) else WARM_FIRST_S
        most = WARM_HANG_S if patient else WARM_MOST_S
        while waiting and time.monotonic() < min(last + quiet, started + most):
            for rank, child in list(waiting.items()):
                if (code := child.poll()) is not None:
                    ended[rank] = code
                    del waiting[rank]
                    last, quiet = time.monotonic(), WARM_QUIET_S
            if waiting:
                time.sleep(0.01)

    def _ready_count(self) -> int:
        """Standbys alive that said they are ready (what the next life can take without waiting)."""
        return sum(1 for standby in self._ready if standby.poll() is None and standby.pid in self._signals
                   and self._has_said(self._signals[standby.pid]))

    def sigkilled(self) -> int:
        """How many idle standbys died of SIGKILL so far (``oom_score_adj`` 1000 makes them the kernel's first
        choice): the agent does not take their out-of-memory kills for a rank's."""
        self._killed.update(standby.pid for standby in self._ready if standby.poll() == -signal.SIGKILL)
        return len(self._killed)

    def _refill(self) -> None:
        self.sigkilled()  # counted before the dead are dropped
        self._forget([standby for standby in self._ready if standby.poll() is not None])
        self._ready = [standby for standby in self._ready if standby.poll() is None]
        self._started, self._said_ready = time.monotonic(), False
        while len(self._ready) < self.count:
            ready, tell = os.pipe()
            os.set_blocking(ready, False)
            try:  # the standby ties itself to this agent (standby_main): no preexec_fn in a threaded process
                self._ready.append(subprocess.Popen(
                    [self.python, "-u", "-m", "hpc_train.rank.agent.standby_main", self.kind, str(tell),
                     str(os.getpid())], env=self.env, stdin=subprocess.PIPE, pass_fds=(tell,)))
            except (OSError, subprocess.SubprocessError) as error:  # out of processes or memory: cold starts
                os.close(ready)
                self.log(f"standby ranks: could not start one ({error}); the next life's ranks start cold")
                return
            finally:
                os.close(tell)
            self._signals[self._ready[-1].pid] = ready

    def _forget(self, standbys: list[subprocess.Popen[bytes]]) -> None:
        """Close the ready pipes of ``standbys`` (taken, or ended)."""
        for standby in standbys:
            ready = self._signals.pop(standby.pid, None)
            if ready is not None:
                self._done.discard(ready)
                os.close(ready)

    def _take(self, argv: list[str], env: Mapping[str, str], cpus: set[int] | None, rank: int | None
              ) -> list[subprocess.Popen[bytes] | RankProcess]:
        """``[the warm process or standby made the rank]``, or ``[]`` where none fits (then a new process)."""
        why = self._unfit(argv, env)
        if why and self.count:  # none will fit this node's ranks: no use keeping or starting any
            self.close(ranks=False)
            self.count = 0
        order = order_line(argv, env, cpus)
        last = self._current.pop(rank, None) if rank is not None else None
        if last is not None:
            if not why and last.poll() is not None and last.rejoin(order):
                self.rejoined += 1
                return [last]
            last.close()
        while not why and self._ready:
            standby = self._ready.pop(0)
            ready = standby.pid in self._signals and self._has_said(self._signals[standby.pid])
            if not ready or standby.poll() is not None or standby.stdin is None:
                self._forget([standby])
                self._kill(standby)  # still importing: the hand-over would wait on it; a new process does not
                continue
            try:
                standby.stdin.write(order)
                standby.stdin.flush()
            except OSError:  # it died between the look and the write
                self._forget([standby])
                self._kill(standby)
                continue
            self.used += 1
            if self.offers_rejoin:  # its standard input and ready pipe stay the rank's channel (rejoin.py)
                channel = self._signals.pop(standby.pid)
                self._done.discard(channel)
                return [RankProcess(standby, standby.stdin, channel)]
            self._forget([standby])
            with contextlib.suppress(OSError):
                standby.stdin.close()
            return [standby]
        if why and not self._said_cold:
            self._said_cold = True
            self.log(f"standby ranks: not used, the ranks start cold: {why}")
        return []

    @staticmethod
    def fits(argv: list[str], python: str = sys.executable) -> bool:
        """Whether a rank started as ``argv`` can come from a standby: this interpreter's ``-u -m MODULE``."""
        return argv[:3] == [python, "-u", "-m"] and len(argv) >= 4

    def _unfit(self, argv: list[str], env: Mapping[str, str]) -> str:
        if not self.fits(argv, self.python):
            return f"the rank command {argv[:4]} is not this interpreter's -u -m MODULE"
        differs = _differs(env, self.env)
        if differs:
            return f"the rank's environment differs from the standby's in {', '.join(differs[:5])}"
        return ""

    def close(self, ranks: bool = True) -> None:
        """End every standby, and with ``ranks`` every rank this pool started or kept warm (the agent leaves: a
        warm one would wait for an order forever). The pool turned off in a life (``ranks=False``) leaves that
        life's ranks running; a warm one the next life does not take is ended then (:meth:`schedule`)."""
        for standby in self._ready:
            self._kill(standby)
        for ready in self._signals.values():
            os.close(ready)
        self._ready, self._signals, self._done, self._due = [], {}, set(), None
        if ranks:
            for rank in (*self._current.values(), *self._starting.values()):
                rank.close()
            self._current, self._starting = {}, {}

    @staticmethod
    def _kill(standby: subprocess.Popen[Any]) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(standby.pid, signal.SIGKILL)
        with contextlib.suppress(OSError):
            if standby.stdin is not None:
                standby.stdin.close()
        standby.wait()
