"""Warm restarts: a rank whose process outlives its life's failure trains the next life in the same process.

When a peer dies, the other ranks see it as an error in a collective, and their processes are still sound: the
imports, the compiled code, the CUDA context are all still there. Such a rank records its failure as before,
lets go of the life (:mod:`hpc_train.rank.train.relife`), says so to its agent over a pipe (one byte,
``WARM_BYTE``) and waits for the next life's order, the same line a standby rank reads
(:mod:`hpc_train.rank.agent.standby_main`). To its agent the rank has ended as one that asks for a restart in
place (``EXIT_RESTART_IN_PLACE``), so nothing else in the agent changes; at the next life's start the agent hands
the order to the warm process of that rank rather than to a standby or a new process.

Each rank the agent starts (``retry.standby``, the built-in trainer) gets two descriptors, named in
``HPC_TRAIN_REJOIN`` as ``ORDERS,WARM``: the orders it reads (a cold rank's standard input, moved aside at once;
a standby's own) and the pipe it writes ``WARM_BYTE`` on. A rank that may not restart warm (a user's program,
FSDP2) never writes it and leaves with its status as before.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
import subprocess
import time
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from typing import IO, Any

from hpc_train.run.exit_codes import EXIT_RESTART_IN_PLACE
from hpc_train.run.procs import kill_tree

__all__ = ["REJOIN_ENV", "WARM_BYTE", "RankProcess", "RejoinChannel", "order_line", "trains_warm"]

REJOIN_ENV = "HPC_TRAIN_REJOIN"
WARM_BYTE = b"w"
_ORDER_LIMIT = 1 << 22  # an order is a command and an environment: far below 4 MiB
_REAP_S = 10.0  # how long closing a rank's process waits for it to be gone
_ORDER_WRITE_S = 30.0  # a warm rank reads its order once it has let go of its life: a second or two at most


def trains_warm(plan: Any) -> bool:
    """Whether a rank of ``plan`` (a :class:`~hpc_train.config.plan.Plan`) may train a later life in its own
    process, which its agent and the rank decide alike: the built-in trainer on DeepSpeed, whose state between lives
    :mod:`hpc_train.rank.train.relife` releases, on CPUs (on GPUs NCCL's error handling ends a rank whose collective
    failed: docs/preemption.md), with standbys and restarts in place on. FSDP2 and users' programs start anew."""
    config = plan.config
    return config.job.program == "train" and config.train.engine == "deepspeed" and \
        plan.resources.gpus_per_node == 0 and config.retry.standby and config.retry.in_place > 0


def order_line(argv: list[str], env: Mapping[str, str], cpus: set[int] | None) -> bytes:
    """The one line that makes a standby or a warm process the rank ``argv`` with ``env`` on ``cpus``."""
    return json.dumps({"argv": argv, "env": dict(env), "cpus": sorted(cpus or ())}).encode() + b"\n"


class RankProcess:
    """The agent's view of a rank's process that may outlive its life: a ``subprocess.Popen`` that reads as ended
    with ``EXIT_RESTART_IN_PLACE`` once the rank said it is warm, while the process waits for its next order."""

    def __init__(self, process: subprocess.Popen[bytes], orders: IO[bytes], warm: int) -> None:
        self.process, self.orders, self.warm_pipe = process, orders, warm
        os.set_blocking(warm, False)
        self.warm = False
        self.killed = False  # the agent killed it: whatever it said last, it is not warm

    @property
    def pid(self) -> int:
        return self.process.pid

    def poll(self) -> int | None:
        code = self.process.poll()
        if code is not None or self.killed:
            self.warm = False
            return code
        return EXIT_RESTART_IN_PLACE if self.warm or self._said_warm() else None

    def wait(self, timeout: float | None = None) -> int:
        """Until the rank ends or says it is warm (a warm process never ends on its own)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while (code := self.poll()) is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.process.args, timeout or 0.0)
            time.sleep(0.01)
        return code

    def kill(self) -> None:
        """SIGKILL to the process and what it started; from now on it reads as the process's own end. Nothing
        once it is reaped: its pid may be another process's by then."""
        self.killed = True
        if self.process.poll() is None:  # an unreaped process keeps its pid
            kill_tree(self.process.pid)

    def _said_warm(self) -> bool:
        """Non-blocking: node 0's agent holds the coordinator's sockets too, whose descriptors pass select's 1023."""
        try:
            self.warm = os.read(self.warm_pipe, 1) == WARM_BYTE
        except BlockingIOError:
            return False
        return self.warm

    def rejoin(self, line: bytes) -> bool:
        """Hand the warm process the next life's order; False when it died meanwhile (start one instead)."""
        if not self.warm or self.killed or self.process.poll() is not None:
            return False
        descriptor = self.orders.fileno()
        deadline = time.monotonic() + _ORDER_WRITE_S
        try:
            os.set_blocking(descriptor, False)  # an order beyond the pipe's 64 KiB waits on the rank's read
            view = memoryview(line)
            while view:
                try:
                    view = view[os.write(descriptor, view):]
                except BlockingIOError:
                    if time.monotonic() > deadline or self.process.poll() is not None:
                        return False
                    time.sleep(0.005)
        except OSError:
            return False
        self.warm = False
        return True

    def close(self) -> None:
        """The process is no one's rank any more: killed with what it started (a warm one waits forever
        otherwise) and reaped."""
        self.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):  # one stuck in the kernel is reaped by the agent later
            self.process.wait(timeout=_REAP_S)
        with contextlib.suppress(OSError):
            self.orders.close()
        with contextlib.suppress(OSError):
            os.close(self.warm_pipe)


@dataclass
class RejoinChannel:
    """The rank's side: the descriptors its agent gave it (``HPC_TRAIN_REJOIN``), adopted once per process."""

    orders: int
    warm: int

    @classmethod
    def adopt(cls, environ: MutableMapping[str, str]) -> RejoinChannel | None:
        """The channel named in ``environ`` (removed from it: a rank's own code has no use for it), standard
        input moved aside when it is the orders (a rank reads nothing on it, as srun's tasks read nothing); None
        without one, or with one that is not two open descriptors."""
        value = environ.pop(REJOIN_ENV, "")
        parts = value.split(",")
        if len(parts) != 2 or not all(part.isdigit() for part in parts):
            return None
        orders, warm = (int(part) for part in parts)
        try:
            if warm <= 2 or orders in (1, 2) or orders == warm or \
                    not all(stat.S_ISFIFO(os.fstat(fd).st_mode) for fd in (orders, warm)):
                return None  # two pipes, never the rank's standard output or error
            if orders == 0:
                orders = os.dup(0)  # not inheritable: the rank's own subprocesses never hold it
                null = os.open(os.devnull, os.O_RDONLY)
                os.dup2(null, 0)
                os.close(null)
            os.set_inheritable(orders, False)
            os.set_inheritable(warm, False)
        except OSError:
            return None
        return cls(orders, warm)

    def say_warm(self) -> bool:
        """Tell the agent this rank has ended its life and will take the next one in this process (it reads as
        ended to the agent from now on); False when the agent is gone."""
        try:
            return os.write(self.warm, WARM_BYTE) == 1
        except OSError:
            return False

    def read_order(self) -> dict[str, Any] | None:
        """The next life's order, ``{"argv", "env", "cpus"}``; None when the agent closed the channel or sent
        something else (the rank then leaves as it would have)."""
        line = b""
        try:
            while not line.endswith(b"\n") and len(line) < _ORDER_LIMIT:
                chunk = os.read(self.orders, 65536)
                if not chunk:
                    return None
                line += chunk
            order = json.loads(line)
        except (OSError, ValueError, RecursionError):
            return None
        return order if _well_formed(order) else None


def _well_formed(order: Any) -> bool:
    """An order as :func:`order_line` writes it: a list of strings, a mapping of strings, a list of CPU numbers."""
    if not isinstance(order, dict):
        return False
    argv, env, cpus = order.get("argv"), order.get("env"), order.get("cpus", [])
    return isinstance(argv, list) and all(isinstance(a, str) for a in argv) and isinstance(env, dict) \
        and all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()) \
        and isinstance(cpus, list) and all(isinstance(c, int) and not isinstance(c, bool) and c >= 0 for c in cpus)
