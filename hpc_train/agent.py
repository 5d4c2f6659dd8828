"""The per-task agent that restarts a rank inside the same Slurm job: ``python -m hpc_train.agent RUN_DIR``.

Why an agent: a requeue gives the allocation back and waits in the queue again for the loss of one rank. srun
starts one agent per task (the srun template, submitit's Slurm path); each agent runs its rank as a child
(``python -m hpc_train.launch RUN_DIR``). When a rank is killed, crashes, hangs or meets a network fault, the
agent that sees it writes the restart notice in the run folder (:mod:`hpc_train.run.in_place`); every agent
then ends its rank and everything the rank started, waits until every rank's agent has done so, and starts its
rank again with a fresh rendezvous port, up to ``retry.in_place`` times. Past that, or for a failure a restart
cannot mend (the program's own error, out of memory, a GPU fault of this node), the agent leaves the way its
rank did, so Slurm and the retry policy see exactly what they saw without it. The agent never imports torch.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

from hpc_train.agent_control import AgentLink
from hpc_train.control.client import ControlError
from hpc_train.run.assignment import node_of
from hpc_train.run.attempts import AttemptLog
from hpc_train.run.chain import successor_of
from hpc_train.run.exit_codes import EXIT_RESTART_IN_PLACE
from hpc_train.run.files import read_record_text
from hpc_train.run.host_memory import memory_peak, oom_kills
from hpc_train.run.in_place import (
    IN_PLACE_ENV,
    IN_PLACE_LEFT_ENV,
    RestartNotice,
    mark_ready,
    read_notice,
    ready_count,
    request_restart,
)
from hpc_train.run.loglines import format_host_oom, rank_log_format
from hpc_train.run.node import node_name
from hpc_train.run.node_log import NodeLogHandler, node_log_name, node_log_path, ranks_per_log
from hpc_train.run.paths import LOGS_DIR, rank_error_path
from hpc_train.run.peer_errors import lost_its_peer
from hpc_train.run.procs import descendants
from hpc_train.run.stops import attempt_key

__all__ = ["Agent", "AgentSetup", "Spares", "agent_setup", "main", "rank_command", "supervise"]

_POLL_S = 0.2
_PEER_CAUSE_WAIT_S = 10.0  # a rank that only lost its peer waits this long for the peer's own cause
_OWN_ERROR_WAIT_S = 3.0  # a rank that failed on its own waits this long for a restart it may have caused
_HANDOVER_GRACE_S = 10.0  # a rank still running this long after its job handed the run to the next job is ended
_BARRIER_S = 180.0  # every agent ends its rank within this; past it, the step is left to Slurm
_PR_SET_CHILD_SUBREAPER = 36


@dataclass(frozen=True)
class AgentSetup:
    """Who this agent is: the run, its rank in the step, the Slurm attempt and how many restarts it may make."""

    run_dir: Path
    rank: int
    world_size: int
    job_id: str
    restart: int
    limit: int
    preempt_signal: str  # the plan's signal (USR2 by default): the rank saves on it, the agent stops restarting
    spares: Spares | None = None  # spares or retry.shrink: this task's place in the allocation
    tasks_per_node: int = 1  # the plan's: which node's log a rank's lines go into


@dataclass(frozen=True)
class Spares:
    """This task's place in an allocation that goes on without a lost node (hot spares, or ``retry.shrink``), and
    the layout it must keep."""

    task: int
    local: int
    node: str
    allocated: tuple[str, ...]
    nodes: int  # the layout's (job.nodes)
    tasks_per_node: int
    shrink: tuple[int, int, int] | None = None  # retry.shrink: (tensor x pipeline x context, micro, global batch)

    def smaller(self, nodes_left: int) -> int | None:
        """The node count a life goes on with when only ``nodes_left`` are left (retry.shrink); None without it."""
        if self.shrink is None:
            return None
        from hpc_train.config.shrink import smaller_size

        size = smaller_size(*self.shrink[:3], self.tasks_per_node, nodes_left)
        return size.nodes if size else None


def agent_setup(run_dir: Path, env: dict[str, str] | None = None) -> AgentSetup | None:
    """The agent's setup when this process is an srun task of a job that restarts in place; None otherwise (the
    local executor, torchrun or mpirun, ``retry.in_place = 0``, or a run folder the rank itself must refuse)."""
    env = dict(os.environ) if env is None else env
    if IN_PLACE_LEFT_ENV in env or not env.get("SLURM_JOB_ID") or "SLURM_STEP_ID" not in env:
        return None
    if env.get("SUBMITIT_EXECUTOR") == "local":
        return None
    try:
        from hpc_train.config.plan import Plan
        from hpc_train.run.folder import check_run_folder
        from hpc_train.run.paths import PLAN_FILE

        check_run_folder(run_dir)
        plan = Plan.from_json((run_dir / PLAN_FILE).read_text(encoding="utf-8"))
        limit = plan.config.retry.in_place if plan.config.job.program != "smoke" else 0
        rank, world = int(env["SLURM_PROCID"]), int(env.get("SLURM_STEP_NUM_TASKS") or env["SLURM_NTASKS"])
        spare, per_node = plan.resources.spare_nodes, plan.resources.tasks_per_node
        spares = None
        if plan.resources.survives_lost_node and world == (plan.resources.nodes + spare) * per_node:
            from hpc_train.distributed.hostlist import expand

            allocated = tuple(expand(env["SLURM_JOB_NODELIST"]))
            lay = plan.layout
            shrink = (lay.tensor * lay.pipeline * lay.context, lay.micro_batch, lay.global_batch)
            spares = Spares(rank, int(env["SLURM_LOCALID"]), node_of(env), allocated, plan.resources.nodes, per_node,
                            shrink if plan.resources.shrink else None)
            rank, world = -1, plan.layout.world  # a rank is given by each life's assignment
    except Exception:  # the rank reports whatever is wrong, in its own words
        return None
    if limit <= 0 or world != plan.layout.world:
        return None
    local = env.get("SLURM_LOCALID", "")
    task, local_rank = int(env["SLURM_PROCID"]), int(local) if local.isdigit() and len(local) < 10 else 0
    return AgentSetup(run_dir, rank, world, env["SLURM_JOB_ID"], int(env.get("SLURM_RESTART_COUNT") or 0), limit,
                      plan.signal, spares, ranks_per_log(task, local_rank, plan.resources.tasks_per_node))


def _logger(run_dir: Path, rank: int, per_node: int, task: int | None = None) -> logging.Logger:
    """Rank ``rank``'s lines in its node's log (rank 0's also on stdout, the batch output), or with ``task`` the
    lines of a task's agent in a job with spares, whose rank changes from life to life: ``taskT`` lines in its
    node's ``logs/agents-FIRST-LAST.log``."""
    name = f"hpc_train.agent{rank}" if task is None else f"hpc_train.agent-task{task}"
    logger = logging.getLogger(name)
    if not logger.handlers:
        logger.setLevel(logging.INFO)
        logger.propagate = False
        (run_dir / LOGS_DIR).mkdir(mode=0o700, exist_ok=True)
        if task is None:
            path, line = node_log_path(run_dir, rank, per_node), rank_log_format(rank)
        else:
            name = node_log_name(task, per_node).replace("ranks-", "agents-", 1)
            path, line = run_dir / LOGS_DIR / name, f"%(asctime)s task{task} %(levelname)s %(message)s"
        handler = NodeLogHandler(path)
        handler.setFormatter(logging.Formatter(line))
        logger.addHandler(handler)
        if rank == 0 and task is None:
            stream = logging.StreamHandler(sys.stdout)
            stream.setFormatter(logging.Formatter(rank_log_format(rank)))
            logger.addHandler(stream)
    return logger


class Agent:
    """Runs one rank and starts it again in place while ``retry.in_place`` allows (see the module's docstring)."""

    def __init__(self, setup: AgentSetup) -> None:
        self.setup = setup
        self.rank = setup.rank  # with spares, the rank of this life's assignment (-1: a spare)
        self.attempt = attempt_key(setup.job_id, setup.restart)
        self.log = _logger(setup.run_dir, setup.rank, setup.tasks_per_node, setup.spares.task if setup.spares else None)
        self.stopping: int | None = None  # a signal from Slurm (preemption, requeue, cancel): no more restarts
        self._successor: str | None = None  # the next job of a chain this one handed the run to
        self._handed_at = 0.0  # when this agent first saw that (monotonic)
        self.link: AgentLink | None = None  # the job's coordinator; None: the run folder's files
        self.holding_nodes: set[str] | None = None  # with spares: the nodes that hold this life's ranks
        self._gone_before = 0  # agents gone when this life began (the coordinator counts them per attempt)

    def logger_for(self, rank: int) -> logging.Logger:
        """The log of rank ``rank`` (with spares, the rank this agent runs in a life)."""
        return _logger(self.setup.run_dir, rank, self.setup.tasks_per_node)

    def _on_signal(self, signum: int, _frame: FrameType | None) -> None:
        self.stopping = signum  # the rank got the same signal from Slurm (it signals every process of the step)

    def take_signals(self) -> None:
        """Slurm's signals (the preemption signal, the TERM of a requeue or a cancel) reach every process of
        the step, the rank too, which acts on them: the agent only stops restarting. It becomes the subreaper
        of what its rank starts, so nothing the rank leaves behind escapes it."""
        preempt = getattr(signal, f"SIG{self.setup.preempt_signal}", None)
        for signum in {*((preempt,) if preempt else ()), signal.SIGTERM, signal.SIGINT, signal.SIGHUP}:
            signal.signal(signum, self._on_signal)
        if sys.platform == "linux":
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)

    def run(self, argv: list[str]) -> int:
        """Run the rank until it ends for good; the status to leave with (negative: the signal it died of)."""
        if self.setup.spares is not None:
            from hpc_train.agent_spares import run_with_spares

            return run_with_spares(self, argv)
        in_place = 0
        self.link = AgentLink.open(self.setup.run_dir, self.attempt, self.setup.job_id, f"rank-{self.rank}",
                                   self.log, host=self.rank == 0)
        coordinator = self.link.environment() if self.link else {}
        while True:
            env = {**os.environ, **coordinator, IN_PLACE_ENV: str(in_place),
                   IN_PLACE_LEFT_ENV: str(self.setup.limit - in_place)}
            code, notice = self._run_once(argv, env, in_place)
            self._end_everything_below()
            if notice is None:
                return code
            self._wait_for_every_rank(notice)
            if self.setup.rank == 0:
                self._record(notice)
            self.log.info("in-place restart %d of %d (retry.in_place): %s: %s (rank %d on %s); starting the rank "
                          "again in job %s", notice.in_place, self.setup.limit, notice.failure_class, notice.reason,
                          notice.rank, notice.host or "?", self.setup.job_id)
            in_place = notice.in_place

    def _run_once(self, argv: list[str], env: dict[str, str], in_place: int) -> tuple[int, RestartNotice | None]:
        """One life of the rank: its exit status, and the restart notice that ends it (None: leave for good)."""
        oom_before = oom_kills()
        child = subprocess.Popen(argv, env=env)
        may_restart = in_place < self.setup.limit
        lost_before = self.link.lost() if self.link is not None else (0, [], [])
        self._gone_before = self.link.gone() if self.link is not None else 0
        while True:
            try:
                code = child.wait(timeout=_POLL_S)
                break
            except subprocess.TimeoutExpired:
                pass
            if may_restart and self.stopping is None:
                notice = self._notice(in_place + 1) or self._restart_for_lost(in_place + 1, lost_before)
                if notice is not None:
                    self._kill(child)
                    return child.wait(), notice
            if self.stopping is None and self._handed_over_for(_HANDOVER_GRACE_S):
                self.log.info("ending rank %d: this job's run goes on as job %s", self.rank, self._successor)
                self._kill(child)  # as scontrol requeue would: no rank waits out its rendezvous for a peer gone
                return child.wait(), None
        if code == 0 or not may_restart or self.stopping is not None or self._handed_over():
            if code != 0 and not may_restart and self._cause(code, oom_before) is not None:
                self.log.info("no in-place restart left (retry.in_place = %d): leaving with status %d for the "
                              "retry policy", self.setup.limit, code)
            return code, None
        return code, self._restart_for(code, oom_before, in_place + 1)

    def _restart_for(self, code: int, oom_before: int, next_in_place: int) -> RestartNotice | None:
        """The notice that restarts the ranks after this rank ended with ``code``, or None to leave with it."""
        cause = self._cause(code, oom_before)
        run_dir = self.setup.run_dir
        if cause is None or cause[0] == "peer":  # maybe a consequence: wait for the cause's own notice
            deadline = time.monotonic() + (_PEER_CAUSE_WAIT_S if cause else _OWN_ERROR_WAIT_S)
            while time.monotonic() < deadline and self.stopping is None and not self._handed_over():
                notice = self._notice(next_in_place)
                if notice is not None:
                    return notice
                if self.link is not None and self.link.usable and self.link.gone() > self._gone_before:
                    break  # the peer's agent is gone with its node: no notice of its own will come
                time.sleep(_POLL_S)
            if cause is None or self.stopping is not None or self._handed_over():
                return None
            cause = ("infrastructure", cause[1])
        notice = RestartNotice(next_in_place, self.rank, node_name(), cause[0], cause[1], time.time())
        if self.link is not None and self.link.usable:
            with contextlib.suppress(ControlError):
                return self.link.request(run_dir, notice)
        return request_restart(run_dir, self.attempt, notice)

    def _restart_for_lost(self, next_in_place: int, before: tuple[int, list[str], list[str]]) -> RestartNotice | None:
        """The restart that an agent's vanishing calls for (its node lost: its connection dropped, or TCP
        keep-alive found its host dead), decided now rather than when a collective on the dead peer fails or
        times out (NCCL's default: 10 minutes); None while no agent that holds ranks vanished in this life (a
        spare's node lost costs the ranks nothing). ``before``: :meth:`AgentLink.lost` when this life began."""
        if self.link is None or not self.link.usable:
            return None
        count, names, nodes = self.link.lost()
        if count <= before[0]:
            return None
        if self.holding_nodes is not None:  # with spares: only a node that holds ranks matters
            new = [node for node in nodes if node not in before[2] and node in self.holding_nodes]
            if not new:
                return None
            names = [f"node {node}" for node in new]
        why = f"the agent of {', '.join(names[-3:]) or '?'} vanished from the job's coordinator (its node lost?)"
        notice = RestartNotice(next_in_place, self.rank, node_name(), "infrastructure", why, time.time())
        with contextlib.suppress(ControlError):
            return self.link.request(self.setup.run_dir, notice)
        return None

    def _notice(self, in_place: int) -> RestartNotice | None:
        """Restart ``in_place``'s notice: pushed by the coordinator (no file read), or from the run folder when
        there is no coordinator (a job with spares) or it went away."""
        if self.link is not None and self.link.usable:
            return self.link.notice(in_place)
        return read_notice(self.setup.run_dir, self.attempt, in_place)

    def _handed_over(self) -> bool:
        """Whether this job already handed the run to the next job of a chain (``[slurm] requeue =
        "dependency"``): a rank that failed submitted it, and this job must end rather than go on in place beside
        it. Where requeue is allowed, ``scontrol requeue`` ends every rank of the job itself."""
        if self._successor is not None:
            return True
        if self.link is not None and self.link.usable:
            successor = self._successor = self.link.successor()
        else:
            successor = self._successor = successor_of(self.setup.run_dir, self.setup.job_id)
        if successor is not None:
            self._handed_at = time.monotonic()
            self.log.info("job %s handed the run to job %s ([slurm] requeue = \"dependency\"): no restart in place",
                          self.setup.job_id, successor)
        return successor is not None

    def _handed_over_for(self, seconds: float) -> bool:
        """Whether this job handed the run on at least ``seconds`` ago (the rank that handed it over is let
        finish its own records first)."""
        return self._handed_over() and time.monotonic() - self._handed_at >= seconds

    def _cause(self, code: int, oom_before: int) -> tuple[str, str] | None:
        """(class, why) of a rank's end that a restart in place may mend; ("peer", why) when it only lost a
        peer; None when it may not (the program's error, out of memory, a stop)."""
        if code < 0:
            from hpc_train.ops.signal_deaths import SIGNAL_NAMES, signal_class

            if code == -signal.SIGKILL and oom_kills() > oom_before:
                peak = memory_peak()  # the cgroup's OOM killer: the retry policy says what to change
                self.log.error(format_host_oom(self.rank, peak.process_bytes, peak.cgroup_bytes,
                                               peak.limit_bytes))
                return None
            failure_class, _meaning = signal_class(-code)
            return failure_class, f"rank {self.rank} ended on {SIGNAL_NAMES.get(-code, f'signal {-code}')}"
        if code != EXIT_RESTART_IN_PLACE:
            return None
        error = self._rank_error()
        return ("peer" if lost_its_peer(error) else "infrastructure"), error[:300] or "asked for a restart"

    def _rank_error(self) -> str:
        """The error this rank recorded (``rank-N.error.json``), read as every run-folder record is: never through
        a link, bounded in size."""
        import json

        try:
            record = json.loads(read_record_text(rank_error_path(self.setup.run_dir, self.rank)) or "{}")
            return str(record.get("error", "")) if isinstance(record, dict) else ""
        except (ValueError, RecursionError):
            return ""

    def _kill(self, child: subprocess.Popen[Any]) -> None:
        for pid in [child.pid, *descendants(child.pid)]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def _end_everything_below(self) -> None:
        """No process the old rank started (a data loader worker, a checkpoint stager) outlives it."""
        for pid in descendants(os.getpid()):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                if os.waitpid(-1, os.WNOHANG) == (0, 0):
                    time.sleep(0.05)
            except ChildProcessError:
                return

    def _wait_for_every_rank(self, notice: RestartNotice) -> None:
        setup = self.setup
        if self.link is not None and self.link.usable:
            with contextlib.suppress(ControlError):
                why = self.link.barrier(notice.in_place, setup.rank, setup.world_size, _BARRIER_S,
                                        lambda: self.stopping is not None)
                if why is None:
                    return
                self.log.error("in-place restart %d: %s; leaving the job to Slurm and the retry policy",
                               notice.in_place, why)
                raise SystemExit(1)
        mark_ready(setup.run_dir, self.attempt, notice.in_place, setup.rank)
        deadline = time.monotonic() + _BARRIER_S
        while ready_count(setup.run_dir, self.attempt, notice.in_place, setup.world_size) < setup.world_size:
            if time.monotonic() > deadline or self.stopping is not None:
                self.log.error("in-place restart %d: not every rank's agent ended its rank within %.0f s (a node "
                               "lost?); leaving the job to Slurm and the retry policy", notice.in_place, _BARRIER_S)
                raise SystemExit(1)
            time.sleep(0.1)

    def _record(self, notice: RestartNotice) -> None:
        """Rank 0's agent: the attempt that ended says why and that it restarted in place."""
        log = AttemptLog(self.setup.run_dir)
        ended = [a for a in log.read() if a.job_id == self.setup.job_id and a.restart == self.setup.restart
                 and a.in_place == notice.in_place - 1]
        # "failed": rank 0's own view when a peer went away first (its gloo or NCCL error), not the cause
        if not ended or ended[-1].outcome not in ("running", "failed"):
            return
        outcome = notice.failure_class if notice.failure_class in ("killed", "crashed", "infrastructure") else "failed"
        log.finish(ended[-1], outcome=outcome, ended=notice.time,
                   note=f"{notice.failure_class}: {notice.reason}; restarted in place "
                        f"({notice.in_place} of retry.in_place = {self.setup.limit})"[:500])


def _leave_like(code: int) -> int:
    """Leave as the rank did: a rank that died of a signal makes its agent die of it, so srun reports the same."""
    if code < 0:
        logging.shutdown()
        sys.stdout.flush()
        if -code not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
        time.sleep(1)  # a signal that does not end a process by default: leave with the shell's status for it
        return 128 - code
    return code


def rank_command(run_dir: Path) -> list[str]:
    return [sys.executable, "-u", "-m", "hpc_train.launch", str(run_dir)]  # unbuffered, as srun lines run python


def supervise(setup: AgentSetup, argv: list[str] | None = None) -> int:
    """Run the rank of ``setup.run_dir`` (or ``argv``) under an agent; the status to leave with."""
    agent = Agent(setup)
    agent.take_signals()
    try:
        code = agent.run(argv or rank_command(setup.run_dir))
    finally:
        if agent.link is not None:
            agent.link.close()  # says bye: the coordinator does not take this agent for lost
    return _leave_like(code)


def settle(run_dir: Path, code: int, job_id: str) -> int:
    """The batch script's status after a step with hot spares: 0 when this job's newest attempt completed (a
    lost node's task made srun's status non-zero though a spare took its ranks), else srun's ``code``."""
    attempts = [a for a in AttemptLog(run_dir).read() if a.job_id == job_id]
    return 0 if attempts and attempts[-1].outcome == "completed" else code


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) == 3 and args[0] == "--settle" and args[2].isdigit():
        return settle(Path(args[1]), int(args[2]), os.environ.get("SLURM_JOB_ID", ""))
    if len(args) != 1:
        print("usage: python -m hpc_train.agent RUN_DIR", file=sys.stderr)
        return 2
    run_dir = Path(args[0])
    setup = agent_setup(run_dir)
    if setup is None:  # nothing to restart: the rank runs in this process, as without an agent
        os.execv(sys.executable, rank_command(run_dir))  # noqa: S606 (a fixed argv, no shell)
    return supervise(setup)


if __name__ == "__main__":
    sys.exit(main())
