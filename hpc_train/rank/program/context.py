"""The run context a user program gets on every rank: ``ctx`` in a function, ``hpc_train.context()`` anywhere.

One context per rank process, held by the session the runner opens (there is no other state at module
level): a function receives it; a script gets it on its first ``hpc_train.context()`` call, which starts the
default process group when the script has not (and joins the one it started when it has).
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, SupportsFloat

import torch
import torch.distributed as dist
from rich.console import Console

from hpc_train.checkpoint.program import UserCheckpoint
from hpc_train.checkpoint.transaction import CheckpointTransaction
from hpc_train.common.topology import Topology
from hpc_train.config.plan import Plan
from hpc_train.rank.distributed.bootstrap import bootstrap
from hpc_train.rank.distributed.collectives import group_device
from hpc_train.rank.distributed.context import RankContext
from hpc_train.rank.distributed.launchers import LaunchInfo
from hpc_train.rank.distributed.mesh import ParallelGroups
from hpc_train.rank.program.stop import StopAgreement
from hpc_train.rank.runtime.exporters import build_exporters
from hpc_train.rank.runtime.health import HealthCheck, RecordHealth, Thresholds
from hpc_train.rank.runtime.monitor import LogLines, Monitor
from hpc_train.rank.runtime.preemption import PreemptionWatch
from hpc_train.rank.runtime.stopping import AttemptRecorder
from hpc_train.rank.runtime.watchdog import Watchdog

__all__ = ["RunContext", "Session", "context", "current_session", "open_session"]

_TIMER_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_]{0,63}")  # a metric name in metrics.jsonl and TensorBoard


@dataclass
class Session:
    """One rank's run of a user program: what the runner was given, and what it opened."""

    plan: Plan
    info: LaunchInfo
    run_dir: Path
    log: Callable[[str], None]
    watch: PreemptionWatch
    recorder: AttemptRecorder
    start_watchdog: Callable[[], Watchdog | None]
    context: RunContext | None = None
    owns_group: bool = False
    started: float = dataclasses.field(default_factory=time.time)  # notices older than this are an earlier run's

    def progress(self, phase: str, step: int | None = None) -> None:
        watchdog = self.start_watchdog()
        if watchdog is not None:
            watchdog.enter(phase, step)


_SESSIONS: list[Session] = []  # the runner's session while a program runs on this rank


def open_session(session: Session | None) -> None:
    """The runner's: ``session`` is the one ``context()`` serves (None: the program has returned)."""
    _SESSIONS.clear()
    if session is not None:
        _SESSIONS.append(session)


def current_session() -> Session | None:
    return _SESSIONS[0] if _SESSIONS else None


def context() -> RunContext:
    """This rank's :class:`RunContext`; the first call in a script joins or starts the default process group."""
    session = current_session()
    if session is None:
        raise RuntimeError("hpc_train.context() works on ranks that hpc_train started (job.program = a function "
                           "or a script); this process was not started by hpc_train")
    if session.context is None:
        session.context = RunContext(session)
    return session.context


def _device(info: LaunchInfo) -> torch.device:
    """The rank's device: its GPU when it has one."""
    return torch.device("cuda", info.local_rank) if torch.cuda.is_available() else torch.device("cpu")


class RunContext(RankContext):
    """What a rank knows and can do: its place, the groups of ``[parallel]``, preemption, checkpoints, metrics."""

    def __init__(self, session: Session) -> None:
        plan, info = session.plan, session.info
        if not dist.is_initialized():
            bootstrap(info, port_range=(plan.port_range[0], plan.port_range[1]), fabric_suffix=plan.fabric_suffix,
                      init_timeout_s=plan.config.dist.init_timeout_s, timeout_s=plan.config.dist.timeout_s)
            session.owns_group = True
        elif dist.get_world_size() != info.world_size:
            raise RuntimeError(f"the program's process group has {dist.get_world_size()} ranks but the job has "
                               f"{info.world_size}: start it with init_method='env://' (hpc_train sets the "
                               "torchrun variables)")
        device = _device(info)
        layout = plan.layout
        topology = Topology.build(info.world_size, tp=layout.tensor, pp=layout.pipeline, cp=layout.context,
                                  order=layout.order)
        super().__init__(plan, info, session.run_dir, ParallelGroups(topology, group_device().type), device)
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self._session = session
        self._stop = StopAgreement(plan, session.watch, session.recorder, session.log)
        self.checkpoint = UserCheckpoint(_checkpointer(session), self.device, session.recorder, session.progress,
                                         session.log, stopping=lambda: self._stop.decision is not None)
        self._monitor: Monitor | None = None
        self.step = 0
        self.step_known = False  # the program has said its step (log, step_done): the stop line names it
        self._timers: dict[str, float] = {}  # seconds in each ctx.timer section since the last log
        session.progress("startup")

    def should_stop(self) -> bool:
        """Collective: True on every rank, at the same call, once a preemption or time-limit signal reached any
        rank. Save, then return from the program: hpc_train records the attempt and requeues it."""
        self._session.progress("step", self.step)
        return self._stop.ask(self.step)

    def log(self, step: int, **scalars: SupportsFloat) -> None:
        """Rank 0 writes ``step`` and ``scalars`` to metrics.jsonl and TensorBoard, and a progress line every
        ``monitor.log_every`` steps (other ranks: nothing); records of this step and later from an earlier
        attempt are dropped first."""
        self.step_done(step)
        if self._timers:
            scalars = {**{f"{name}_ms": 1000 * seconds for name, seconds in self._timers.items()}, **scalars}
            self._timers = {}
        if self._monitor is None:
            monitor = self._session.plan.config.monitor
            self._monitor = Monitor.create(self.rank, self.run_dir, total_steps=0, log_every=monitor.log_every,
                                           tensorboard=monitor.tensorboard, start_step=max(0, step - 1),
                                           console=Console(file=LogLines(self._session.log), width=200),
                                           exporters=self._exporters)
        self._monitor.scalars(step, scalars)

    def _exporters(self) -> list[Any]:
        """Rank 0's record consumers: the health checks over the program's records, and ``[monitor]``'s
        exporters."""
        plan = self._session.plan
        monitor = plan.config.monitor
        gpus = self.device.type == "cuda"
        limits = Thresholds(monitor.health_data_share, monitor.health_loss_spike, monitor.health_memory_growth,
                            -1, monitor.health_comm_share, gpus=gpus,  # -1: the program's own loader
                            network=gpus or plan.resources.nodes > 1)
        health = RecordHealth(HealthCheck(self.run_dir, limits, self._session.log), every=monitor.log_every)
        return [health, *build_exporters(plan, self.run_dir, self._session.log)]

    @contextlib.contextmanager
    def timer(self, name: str) -> Iterator[None]:
        """Time a section of your loop (host wall clock): the seconds spent in it since the previous
        :meth:`log` go into that record as ``NAME_ms``. On a GPU it measures what the host waits for; put a
        ``torch.cuda.synchronize()`` at the section's end for the device's time."""
        if not _TIMER_NAME.fullmatch(name):
            raise ValueError(f"ctx.timer({name!r}): a timer's name is a metric name: letters, digits and _, "
                             "starting with a letter (like 'data' or 'all_reduce')")
        began = time.perf_counter()
        try:
            yield
        finally:
            self._timers[name] = self._timers.get(name, 0.0) + time.perf_counter() - began

    def step_done(self, step: int) -> None:
        """The program has finished ``step`` (no metrics): the stop line, ``attempts.jsonl`` and the hang
        watchdog name it. :meth:`log` does this too; the library integrations call it every step."""
        self.step, self.step_known = step, True
        self._session.progress("step", step)

    def close(self) -> None:
        """The program has returned: close the metrics, settle the stop flag's last all-reduce."""
        self._stop.settle()
        if self._monitor is not None:
            self._monitor.close()

    @property
    def stop(self) -> StopAgreement:
        return self._stop


def _checkpointer(session: Session) -> CheckpointTransaction:
    """The runtime's checkpoint transaction; the manifest's dtype is the config's precision, fp32 where it is
    ``auto``."""
    config = session.plan.config
    precision = "fp32" if config.train.precision == "auto" else config.train.precision
    config = dataclasses.replace(config, train=dataclasses.replace(config.train, precision=precision))
    return CheckpointTransaction(session.run_dir, config, session.plan.layout, session.plan.config_hash,
                                 log=session.log)
