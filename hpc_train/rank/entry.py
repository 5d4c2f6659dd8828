"""The entry point every rank runs, from any launcher: ``python -m hpc_train.launch RUN_DIR``.

It reads ``plan.json`` from the run folder (plain JSON, no pickles), finds its rank, appends its log lines to
its node's log ``logs/ranks-FIRST-LAST.log`` (:mod:`hpc_train.run.node_log`) and runs the job. Submitit calls the
same code through :class:`hpc_train.launch.RankEntry`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any, NoReturn

from hpc_train.backends import LocalBackend, backend_of
from hpc_train.config.plan import Plan, plan_for_life
from hpc_train.errors import ConfigError
from hpc_train.rank.agent.rejoin import RejoinChannel, trains_warm
from hpc_train.rank.runtime.malloc import describe as describe_heap
from hpc_train.rank.runtime.malloc import steady_heap
from hpc_train.rank.runtime.preemption import PreemptionWatch
from hpc_train.rank.runtime.watchdog import THREAD_NAME as WATCHDOG_THREAD
from hpc_train.rank.train.relife import life_released
from hpc_train.run.error_log import CONSEQUENCES, ERROR_LOG_ENV, ERRORS, append_error, error_log_ranks
from hpc_train.run.exit_codes import EXIT_NOT_RETRIED, EXIT_RESTART_IN_PLACE, EXIT_STOPPED
from hpc_train.run.files import atomic_write
from hpc_train.run.folder import check_run_folder
from hpc_train.run.in_place import in_place_left
from hpc_train.run.loglines import format_launch_error, format_start, format_stopped, rank_log_format
from hpc_train.run.node import node_name
from hpc_train.run.node_log import NodeLogHandler, node_log_path, ranks_per_log
from hpc_train.run.paths import (
    PLAN_FILE,
    fabric_report_path,
    rank_consequence_path,
    rank_error_path,
)
from hpc_train.run.procs import parent_death_signal, tie_to_parent
from hpc_train.run.quick_exit import exit_quickly_when_done, leave_now
from hpc_train.run.results import Stopped, rank_result
from hpc_train.run.stops import StopConsequence

__all__ = ["main", "run_rank"]


def _rank_logger(run_dir: Path, rank: int, per_node: int) -> logging.Logger:
    """Each rank logs into its node's log (``logs/ranks-FIRST-LAST.log``, each line carrying the rank); only rank 0
    also speaks on stdout, other ranks stay quiet."""
    logger = logging.getLogger(f"hpc_train.rank{rank}")
    logger.setLevel(logging.INFO)
    logger.propagate = False
    for old in list(logger.handlers):  # an earlier life of this process (a warm restart) had its own
        logger.removeHandler(old)
        old.close()
    formatter = logging.Formatter(rank_log_format(rank))
    handler = NodeLogHandler(node_log_path(run_dir, rank, per_node))
    handler.setFormatter(formatter)
    logger.addHandler(handler)
    if rank == 0:
        stream = logging.StreamHandler(sys.stdout)
        stream.setFormatter(formatter)
        logger.addHandler(stream)
    return logger


def _tie_to_local_controller() -> None:
    """Below the local executor's controller a rank never outlives it: killed with it, or, when the controller
    ended while this rank was still importing, gone at once (no one is left to follow or to stop it)."""
    controller = os.environ.get("SUBMITIT_LOCAL_JOB_ID", "")  # submitit names a local job by its controller's pid
    if controller.isdigit() and not tie_to_parent(int(controller)):
        raise SystemExit(f"hpc_train: the local job's controller (pid {controller}) ended before this rank started")
    if not controller.isdigit():
        parent_death_signal()()


class WarmRestart(BaseException):  # not an error: the end of a life, past every handler of errors
    """This rank's life ended in a failure that a restart in place mends, and this process trains the next life
    itself (:mod:`hpc_train.rank.agent.rejoin`): raised once the failure is recorded, caught by :func:`main`."""


def run_rank(run_dir: Path, may_rejoin: bool = False) -> dict[str, Any]:
    """Run this rank's share of the job in ``run_dir``; return its result. ``may_rejoin``: a failure that a
    restart in place mends raises :class:`WarmRestart` instead of leaving the process (the agent gave a channel)."""
    os.umask(0o077)  # logs and results of a run are private, like the run folder
    if isinstance(backend_of(os.environ), LocalBackend):
        _tie_to_local_controller()
    check_run_folder(run_dir)  # never reached through a link, nor writable by others: ranks run what it holds
    os.environ["HPC_TRAIN_RUN_DIR"] = str(run_dir)  # for a script, whatever launched it (docs/your-own-code.md)
    plan = plan_for_life(Plan.from_json((run_dir / PLAN_FILE).read_text(encoding="utf-8")), os.environ)
    if plan.config.job.program == "smoke":  # nothing to save: signals keep their usual meaning
        return _run_rank(run_dir, plan, None)
    with PreemptionWatch([plan.signal]) as watch:  # first thing: a signal while starting up is kept for later
        return _run_rank(run_dir, plan, watch, may_rejoin and trains_warm(plan))


def _run_rank(run_dir: Path, plan: Plan, watch: PreemptionWatch | None, may_rejoin: bool = False
              ) -> dict[str, Any]:
    from hpc_train.rank.distributed.launchers import Geometry, check_geometry, detect_launch
    from hpc_train.rank.distributed.smoke import run_smoke  # the trainer is imported only when the job trains

    info = detect_launch(expected_world=plan.layout.world)
    heap = steady_heap() if info.kind.own_process else None  # not in someone's own Python: it is for good
    logger = _rank_logger(run_dir, info.rank, ranks_per_log(info.rank, info.local_rank, plan.resources.tasks_per_node))
    on_slurm = backend_of(os.environ).on_slurm
    program = plan.config.job.program
    looks_back = on_slurm and program != "smoke" and not info.in_place  # in place: the agent looked at a restart
    _clear_own_records(run_dir, info.rank, keep_error=looks_back and info.restart > 0)
    logger.info("%s", format_start(info.launcher, info.rank, info.world_size, info.local_rank, info.local_world_size,
                                   info.node_rank, info.num_nodes, info.job_id, info.restart, node_name()))
    if info.rank == 0 and info.kind.own_process:
        logger.info("%s", describe_heap(heap))
    looking = LookBack.start(run_dir, plan, info, logger) if looks_back and info.rank == 0 else None
    _prepare_fabric(run_dir, plan, info.local_rank, logger)
    if looking is not None:  # the look-back runs while this rank imports torch (the other ranks wait for rank 0's
        looking.settle(while_importing=program)  # store either way); its verdict is carried out before any group
    try:
        check_geometry(info, Geometry(plan.resources.nodes, plan.resources.tasks_per_node,
                                      plan.resources.gpus_per_node))  # before any process group
        if program == "smoke":
            result = run_smoke(plan, info)
        elif program == "train":
            from hpc_train.rank.train.trainer import train

            result = train(plan, info, run_dir, logger.info, watch, warm=may_rejoin)
        else:
            from hpc_train.rank.program.runner import run_program

            result = run_program(plan, info, run_dir, logger.info, watch)
    except StopConsequence as stop:  # a peer had left on the stop: the stop's status, not a failure's
        _record_consequence(run_dir, info.rank, stop, logger)
        _leave(info, stop.notice.exit_code)
    except BaseException as error:
        if _record_failure(run_dir, plan, info, error, on_slurm and program != "smoke", logger):
            if may_rejoin and info.kind.own_process and not (watch is not None and watch.received) \
                    and life_released(error) and not _watchdog_busy():
                logger.info("restarting warm: this process trains the next life once its agent says so")
                raise WarmRestart(info.rank) from None
            _leave(info, EXIT_RESTART_IN_PLACE)  # the agent above this rank starts every rank again
        raise
    typed = rank_result(result)
    if isinstance(typed, Stopped):  # saved after a preemption signal: leave without a result, with the agreed status
        logger.info("%s", format_stopped(typed.step, typed.signal, typed.requeue, typed.reason, typed.exit_code))
        _leave(info, typed.exit_code)
    if (line := typed.summary()) is not None:
        logger.info("%s", line)
    if info.rank == 0:
        atomic_write(run_dir / typed.file, json.dumps(result, indent=2) + "\n")
    if info.kind.own_process:  # a launcher's rank process, not someone's own Python calling run_rank
        exit_quickly_when_done()
    return result


def _watchdog_busy() -> bool:
    """Whether the failed life's watchdog is still handling a hang (it may end this process yet): then no warm
    restart. A life ends its watchdog before it leaves, waiting 5 s for it."""
    return any(thread.name == WATCHDOG_THREAD and thread.is_alive() for thread in threading.enumerate())


def _leave(info: Any, code: int) -> NoReturn:
    """A stopped rank's exit with the agreed status: at once from a launcher's rank process (inside the signal
    handlers, see :func:`leave_now`), as ``SystemExit`` where someone's own Python called :func:`run_rank`."""
    if info.kind.own_process:
        leave_now(code)
    raise SystemExit(code)


def _record_failure(run_dir: Path, plan: Plan, info: Any, error: BaseException, may_retry: bool,
                    logger: logging.Logger) -> bool:
    """The rank's traceback in its log and ``rank-N.error.json``, written after the retry policy has acted and
    saying what it did: a follower on the login node never cancels a job that one of its ranks is requeuing.
    True when an in-place restart mends the error (a network fault, a peer that went away) and this rank leaves
    for its agent to start it again, instead of a requeue."""
    from hpc_train.failures.recovery import mended_in_place

    text = _traceback_text(error)
    logger.error("failed:\n%s", text)
    requeued = in_place = False
    if may_retry and not isinstance(error, SystemExit):
        in_place = in_place_left(os.environ) > 0 and mended_in_place(info.rank, node_name(), repr(error), text)
        if not in_place:
            requeued = _requeue_after_error(run_dir, plan, info, repr(error), text, logger)
    report = {"rank": info.rank, "host": node_name(), "time": time.time(), "job_id": info.job_id,
              "restart": info.restart, "error": repr(error),
              "traceback": text, "requeued": requeued, "restart_in_place": in_place, "in_place": info.in_place}
    _write_record(run_dir, info.rank, rank_error_path(run_dir, info.rank), report)
    if in_place:
        logger.info("leaving for an in-place restart (the agent starts every rank again from the last checkpoint)")
    return in_place


def _record_consequence(run_dir: Path, rank: int, stop: StopConsequence, logger: logging.Logger) -> None:
    """One warning line in the rank's log and ``rank-N.consequence.json`` with the traceback: what the program
    raised once its attempt had stopped, recorded as such."""
    notice = stop.notice
    logger.warning("after the stop on %s (%s: %s): %r; a consequence of the stop (the other ranks left), not "
                   "a failure", notice.signal, notice.action, notice.reason, stop.error)
    text = "".join(traceback.format_exception(stop.error))
    report = {"rank": rank, "host": node_name(), "time": time.time(), "error": repr(stop.error), "traceback": text,
              "consequence": f"the attempt had stopped on {notice.signal} ({notice.action}: {notice.reason})"}
    _write_record(run_dir, rank, rank_consequence_path(run_dir, rank), report, CONSEQUENCES)


def _write_record(run_dir: Path, rank: int, own: Path, report: dict[str, Any], kind: str = ERRORS) -> None:
    """A rank's record: appended to its node's file where the node's agent keeps one (:mod:`hpc_train.run.
    error_log`: one file per node, not per rank), else its own file ``own``."""
    node_file = _node_record_file(rank, kind)
    if node_file:
        append_error(run_dir, node_file, report)
    else:
        atomic_write(own, json.dumps(report, indent=2) + "\n")


def _node_record_file(rank: int, kind: str) -> str:
    """The node's record file its agent named for this rank (``HPC_TRAIN_ERROR_LOG``), or "" without one."""
    name = os.environ.get(ERROR_LOG_ENV, "")
    holds = error_log_ranks(name)
    if holds is None or rank not in holds or not name.startswith(f"{ERRORS}-"):
        return ""
    return name.replace(f"{ERRORS}-", f"{kind}-", 1)


def _traceback_text(error: BaseException) -> str:
    """The traceback worth reading, from the first frame of the user's code (:func:`user_traceback`). A user
    program that could not start or exited badly (``UserCodeError``): its own traceback (an import error,
    ``user_cause``), if any, and our one line."""
    from hpc_train.rank.program.tracebacks import user_traceback

    if not hasattr(error, "user_cause"):
        return user_traceback(error)
    cause = error.user_cause
    own = user_traceback(cause) if isinstance(cause, BaseException) else ""
    return own + f"{type(error).__name__}: {error}\n"


def _clear_own_records(run_dir: Path, rank: int, keep_error: bool) -> None:
    """Remove this rank's records of an earlier attempt; with ``keep_error`` (a requeued attempt) its error record
    is moved aside for rank 0's look-back, which removes it once read (:mod:`hpc_train.run.error_records`)."""
    if _node_record_file(rank, ERRORS):
        return  # the node's agent cleared (or kept aside) the node's file before this rank started
    if keep_error:
        from hpc_train.run.error_records import keep_aside

        keep_aside(run_dir, rank)
    else:
        rank_error_path(run_dir, rank).unlink(missing_ok=True)
    rank_consequence_path(run_dir, rank).unlink(missing_ok=True)


def _import_quietly(program: str) -> None:
    """Import the module that runs ``program`` (torch, DeepSpeed: seconds); a failure shows again where the rank
    imports it for real, and is recorded there as the rank's error."""
    import importlib

    with contextlib.suppress(Exception):
        importlib.import_module("hpc_train.rank.train.trainer" if program == "train"
                                else "hpc_train.rank.program.runner")


class LookBack:
    """A requeued attempt's rank 0 acting on why the previous attempt ended (node failure, infrastructure), in a
    thread beside the rank's own start-up: off the start-up path while it takes less than the imports do."""

    def __init__(self, run_dir: Path, plan: Plan, info: Any, logger: logging.Logger) -> None:
        self._args = (run_dir, plan, info, logger)
        self._exit: int | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="hpc_train-look-back", daemon=True)

    @classmethod
    def start(cls, run_dir: Path, plan: Plan, info: Any, logger: logging.Logger) -> LookBack:
        looking = cls(run_dir, plan, info, logger)
        looking._thread.start()
        return looking

    def settle(self, while_importing: str | None = None) -> None:
        """Wait for the verdict (after importing what runs ``while_importing``, a program kind): go on, or leave
        with the status it chose (SystemExit), or its own error."""
        if while_importing is not None:
            _import_quietly(while_importing)
        self._thread.join()
        if self._error is not None:
            raise self._error
        if self._exit is not None:
            raise SystemExit(self._exit)

    def _run(self) -> None:
        try:
            self._exit = _look_back(*self._args)
        except BaseException as error:  # carried to the rank's main thread by settle()
            self._error = error


def _look_back(run_dir: Path, plan: Plan, info: Any, logger: logging.Logger) -> int | None:
    """A requeued attempt: act on why the previous one ended (node failure, infrastructure) before training; the
    exit status to leave with, or None to go on (then the previous attempt's records kept aside are removed)."""
    from hpc_train.common.hostlist import expand
    from hpc_train.failures.policy import RetryPolicy
    from hpc_train.failures.recovery import look_back
    from hpc_train.run.error_records import clear_kept, ranks_with_records

    recorded = ranks_with_records(run_dir) if info.restart > 0 else []
    recovery = look_back(run_dir, info.job_id, info.restart, RetryPolicy.from_section(plan.config.retry),
                         expand(info.nodelist) if info.nodelist else [socket.gethostname()], logger.info,
                         failed_ranks=recorded)
    if recovery.failure_class:  # the message may already begin with the class ("preempted: the run was ...")
        said = recovery.message if recovery.message.startswith(f"{recovery.failure_class}:") else \
            f"{recovery.failure_class}: {recovery.message}"
        logger.info("previous attempt: %s", said)
    if recovery.action == "stop":
        logger.error("not retried: %s", recovery.message)
        return EXIT_NOT_RETRIED  # the records stay: they say why the run stopped
    if recovery.action == "requeue":
        logger.info("%s", recovery.message)
        return EXIT_STOPPED
    clear_kept(run_dir)
    return None


def _requeue_after_error(run_dir: Path, plan: Plan, info: Any, error: str, text: str,
                         logger: logging.Logger) -> bool:
    """An infrastructure fault on this rank (not the program's error): exclude this node and requeue. True when
    the job was requeued."""
    from hpc_train.failures.policy import RetryPolicy
    from hpc_train.failures.recovery import requeue_after_error

    recovery = requeue_after_error(run_dir, info.job_id, info.restart, info.rank, node_name(), error, text,
                                   RetryPolicy.from_section(plan.config.retry), logger.info, in_place=info.in_place)
    if recovery.failure_class:
        logger.info("%s: %s", recovery.failure_class, recovery.message)
    return recovery.action == "requeue"


_FABRIC_VARIABLES = ("NCCL_", "GLOO_", "TORCH_NCCL_", "TORCH_FR_")


def _prepare_fabric(run_dir: Path, plan: Plan, local_rank: int, logger: logging.Logger) -> None:
    """Complete the NCCL environment from this node's fabric before torch starts, and say what contradicts it.

    The first rank of each node also leaves ``logs/fabric-HOST.json`` (what the node showed, what was set, what
    was found) for ``doctor`` and for whoever debugs a slow or hung job later.
    """
    from hpc_train.fabric.nccl import prepare_node_env
    from hpc_train.fabric.sysfs import read_fabric

    fabric = read_fabric(os.environ.get("HPC_TRAIN_SYSFS", "/sys"))
    node = prepare_node_env(os.environ, plan.interconnect, plan.nccl_detect, fabric)
    for name, value in node.detected.items():
        logger.info("fabric: %s=%s (detected on this node)", name, value)
    for finding in node.findings:
        logger.warning("fabric: %s: %s; fix: %s", finding.variable, finding.message, finding.fix)
    if local_rank == 0:
        report = {"host": socket.gethostname(), "kind": fabric.kind,
                  "active_ports": [f"{d.name}:{p.number}" for d, p in fabric.active_ib_ports()],
                  "detected": node.detected, "findings": [vars(f) for f in node.findings],
                  "env": {k: v for k, v in sorted(os.environ.items()) if k.startswith(_FABRIC_VARIABLES)}}
        atomic_write(fabric_report_path(run_dir, socket.gethostname()), json.dumps(report, indent=2) + "\n")


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m hpc_train.launch RUN_DIR", file=sys.stderr)
        return 2
    channel = RejoinChannel.adopt(os.environ)  # the agent's, for a warm restart: once, in a process's first life
    run_dir = Path(args[0])
    while True:
        code = _life(run_dir, channel is not None)
        if code is not None:
            return code
        order = _next_life(channel) if channel is not None else None
        if order is None:  # the agent is gone or ended the job: leave as a rank that asked for a restart
            leave_now(EXIT_RESTART_IN_PLACE)
        run_dir = Path(order["argv"][-1])


def _life(run_dir: Path, may_rejoin: bool) -> int | None:
    """One life of this rank: its exit status, or None when the process trains the next life (a warm restart)."""
    from hpc_train.rank.distributed.launchers import LaunchError
    from hpc_train.rank.distributed.rendezvous import RendezvousError

    try:
        run_rank(run_dir, may_rejoin)
    except WarmRestart:
        return None
    except (LaunchError, RendezvousError) as error:  # a wrong launch, said in one line on every rank
        print(format_launch_error(error), file=sys.stderr)
        return 1
    except ConfigError as error:  # the run folder was refused
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0


def _next_life(channel: RejoinChannel) -> dict[str, Any] | None:
    """Let go of the failed life's groups, tell the agent this process is warm, free the rest of the life (its
    stack is unwound by now, so its engine is garbage), then wait for the next life's order and take it: its
    environment, CPUs and arguments. Anything that fails on the way leaves as the rank would have, at once."""
    from hpc_train.control.events import forget_broken
    from hpc_train.rank.agent.standby_main import take_order
    from hpc_train.rank.train.relife import forget_groups, free_heap

    try:
        forget_groups()
        forget_broken()  # the next life connects to the coordinator again where the last one's link broke
        if not channel.say_warm():
            return None
        free_heap()
        order = channel.read_order()
        if order is None or order["argv"][-3:-1] != ["-m", "hpc_train.launch"]:  # a rank's command, nothing else
            return None
        take_order(order)
    except Exception:  # whatever it is, this process leaves as a rank that asked for a restart
        return None
    return order


if __name__ == "__main__":
    sys.exit(main())
