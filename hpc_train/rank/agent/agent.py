"""The node agent that starts, watches and restarts its node's ranks inside the same Slurm job:
``python -m hpc_train.agent RUN_DIR``.

Why an agent: a requeue gives the allocation back and waits in the queue again for the loss of one rank. srun
(the srun template, submitit's Slurm path) starts one agent per node (:attr:`Plan.node_agents`), and the agent
starts the node's ranks as its children (``python -m hpc_train.launch RUN_DIR``), each with the ``SLURM_*``
place it would have had as a task of its own. When a rank is killed, crashes, hangs or meets a network fault, the
agent that sees it sets the restart notice on the job's coordinator (:mod:`hpc_train.rank.agent.link`; the run
folder keeps the record); every agent then ends its ranks and everything they started, arrives once at the
restart barrier (one message per node), and starts its ranks again with a fresh rendezvous port, up to
``retry.in_place`` times. Past that, or for a failure a restart cannot mend (the program's own error, out of
memory, a GPU fault of this node), the agent ends its other ranks and leaves the way the failed rank did, so
Slurm and the retry policy see what they saw without it. The agent never imports torch.
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
from pathlib import Path
from types import FrameType
from typing import Any

from hpc_train.control.client import ControlError
from hpc_train.rank.agent.agent_log import agent_logger
from hpc_train.rank.agent.link import AgentLink
from hpc_train.rank.agent.memory import NodeMemory, memory_environment
from hpc_train.rank.agent.rejoin import RankProcess
from hpc_train.rank.agent.setup import AgentSetup, Spares, agent_setup
from hpc_train.rank.agent.standby import StandbyPool
from hpc_train.run.assignment import Assignment, rank_environments
from hpc_train.run.attempts import AttemptLog
from hpc_train.run.chain import successor_of
from hpc_train.run.error_log import ERROR_LOG_ENV, clear_node_records, error_log_name, read_error_log
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
from hpc_train.run.loglines import format_host_oom
from hpc_train.run.node import node_name
from hpc_train.run.paths import LOGS_DIR, rank_error_path
from hpc_train.run.peer_errors import lost_its_peer
from hpc_train.run.procs import cpu_shares, descendants, kill_tree, leave_like
from hpc_train.run.stops import attempt_key

__all__ = ["Agent", "AgentSetup", "Spares", "agent_setup", "main", "rank_command", "supervise"]

_POLL_S = 0.2
_PEER_CAUSE_WAIT_S = 10.0  # a rank that only lost its peer waits this long for the peer's own cause
_OWN_ERROR_WAIT_S = 3.0  # a rank that failed on its own waits this long for a restart it may have caused
_HANDOVER_GRACE_S = 10.0  # a rank still running this long after its job handed the run to the next job is ended
_BARRIER_S = 180.0  # every agent ends its rank within this; past it, the step is left to Slurm
_PR_SET_CHILD_SUBREAPER = 36
# What srun set for the node's one task that would tell a rank a wrong place: an MPI plugin's rank (srun --mpi, or
# a site's MpiDefault: the launcher detection reads PMI_RANK before SLURM_PROCID), the task's global ids, its
# CPU binding (each rank gets its own share instead). A site's own settings (OMPI_MCA_*, PMIX_MCA_*) stay.
_TASK_ONLY = ("PMI_RANK", "PMI_SIZE", "PMI_FD", "PMI_JOBID", "PMIX_RANK", "OMPI_COMM_WORLD_", "SLURM_GTIDS",
              "SLURM_CPU_BIND", "SLURM_TASK_PID", "SLURM_LAUNCH_NODE_IPADDR")


Children = dict[int, "subprocess.Popen[bytes] | RankProcess"]  # a life's ranks on this node, by rank


class Agent:
    """Runs its node's ranks and starts them again in place while ``retry.in_place`` allows (see the module's
    docstring)."""

    def __init__(self, setup: AgentSetup) -> None:
        self.setup = setup
        per_node = setup.tasks_per_node
        self.rank = setup.node * per_node  # this node's first rank (with spares, in this life's assignment; -1: none)
        self.attempt = attempt_key(setup.job_id, setup.restart)
        self.log = agent_logger(setup.run_dir, self.rank, per_node, setup.node if setup.spares else None)
        self.stopping: int | None = None  # a signal from Slurm (preemption, requeue, cancel): no more restarts
        self._successor: str | None = None  # the next job of a chain this one handed the run to
        self._handed_at = 0.0  # when this agent first saw that (monotonic)
        self.link: AgentLink | None = None  # the job's coordinator; None: the run folder's files
        self.holding_nodes: set[str] | None = None  # with spares: the nodes that hold this life's ranks
        self._gone_before = 0  # agents gone when this life began (the coordinator counts them per attempt)
        self.standby: StandbyPool | None = None  # retry.standby: the next life's ranks, imports done
        self.memory: NodeMemory | None = None  # checkpoint.memory_every_steps: the ranks' states, held here

    def logger_for(self, rank: int) -> logging.Logger:
        """The log of rank ``rank`` (with spares, this node's first rank in a life)."""
        return agent_logger(self.setup.run_dir, rank, self.setup.tasks_per_node)

    def node_environment(self) -> dict[str, str]:
        """What every rank of this node shares: the step's environment and the rank's share of the CPUs."""
        cpus = {"SLURM_CPUS_PER_TASK": str(self.setup.cpus_per_rank)} if self.setup.cpus_per_rank else {}
        return {**{name: value for name, value in os.environ.items() if not name.startswith(_TASK_ONLY)}, **cpus}

    def rank_environments(self, places: dict[int, dict[str, str]], extra: dict[str, str]) -> dict[int, dict[str, str]]:
        """Each rank's environment: the node's (:meth:`node_environment`), its ``SLURM_*`` place, ``extra``."""
        per_node, node = self.setup.tasks_per_node, self.node_environment()
        return {rank: {**node, **place, **extra, ERROR_LOG_ENV: error_log_name(rank, per_node)}
                for rank, place in places.items()}

    def oom_kills(self) -> int:
        """The job's out-of-memory kills on this node, less the idle standbys' (the kernel's first choice)."""
        return oom_kills() - (self.standby.sigkilled() if self.standby is not None else 0)

    def keep_standbys(self, argv: list[str]) -> None:
        """``retry.standby``: one standby rank per rank of the node, for the lives after the first; none where
        the ranks are not ``python -u -m MODULE`` (what a standby becomes)."""
        if self.setup.standby and self.setup.limit > 0 and StandbyPool.fits(argv):
            self.standby = StandbyPool(self.setup.standby, self.setup.tasks_per_node, self.node_environment(),
                                       self.log.info, rejoin=self.setup.warm)

    def _on_signal(self, signum: int, _frame: FrameType | None) -> None:
        self.stopping = signum  # the ranks got the same signal from Slurm (it signals every process of the step)

    def take_signals(self) -> None:
        """Slurm's signals (the preemption signal, the TERM of a requeue or a cancel) reach every process of
        the step, the ranks too, which act on them: the agent only stops restarting. It becomes the subreaper
        of what its ranks start, so nothing a rank leaves behind escapes it."""
        preempt = getattr(signal, f"SIG{self.setup.preempt_signal}", None)
        for signum in {*((preempt,) if preempt else ()), signal.SIGTERM, signal.SIGINT, signal.SIGHUP}:
            signal.signal(signum, self._on_signal)
        if sys.platform == "linux":
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)

    def run(self, argv: list[str]) -> int:
        """Run the node's ranks until they end for good; the status to leave with (negative: a signal)."""
        setup = self.setup
        if setup.spares is not None:
            from hpc_train.rank.agent.spares import run_with_spares

            return run_with_spares(self, argv)
        in_place = 0
        self.keep_standbys(argv)
        self.link = AgentLink.open(setup.run_dir, self.attempt, setup.job_id, setup.member, self.log,
                                   host=setup.node == 0)
        self.memory = NodeMemory.open(setup, self.link, self.attempt, self.log)
        coordinator = {**(self.link.environment() if self.link else {}), **memory_environment(self.memory)}
        places = rank_environments(Assignment(0, list(setup.nodes)), setup.node_name, setup.tasks_per_node)
        while True:
            extra = {**coordinator, IN_PLACE_ENV: str(in_place), IN_PLACE_LEFT_ENV: str(setup.limit - in_place)}
            code, notice = self.run_once(argv, self.rank_environments(places, extra), in_place)
            self.end_everything_below()
            if notice is None:
                return code
            self._wait_for_every_node(notice)
            if setup.node == 0:
                self.record(notice)
            if self.stopping is not None:  # Slurm's signal came while the ranks were down: none would hear it
                self.log.error("in-place restart %d: Slurm's signal came while the ranks were down; not starting "
                               "them again: leaving the job to Slurm and the retry policy", notice.in_place)
                return 1  # as a barrier that Slurm's signal cut short
            self.log.info("in-place restart %d of %d (retry.in_place): %s: %s (rank %d on %s); starting the ranks "
                          "again in job %s", notice.in_place, setup.limit, notice.failure_class, notice.reason,
                          notice.rank, notice.host or "?", setup.job_id)
            in_place = notice.in_place

    def run_once(self, argv: list[str], envs: dict[int, dict[str, str]], in_place: int
                 ) -> tuple[int, RestartNotice | None]:
        """One life of the node's ranks (``envs``: each one's environment): the status to leave with, and the
        restart notice that ends the life (None: leave for good)."""
        oom_before = self.oom_kills()
        if envs:  # the agent is the only clearer of its node's record files, before its ranks run
            clear_node_records(self.setup.run_dir, min(envs), self.setup.tasks_per_node,
                               keep_aside=self.setup.restart > 0 and in_place == 0)
        children = self._spawn(argv, envs)
        try:
            return self._watch(children, in_place, oom_before)
        except BaseException:  # an error of the agent's own (a full disk): no rank is left running without it
            self._end(children, {})
            raise

    def _watch(self, children: Children, in_place: int, oom_before: int) -> tuple[int, RestartNotice | None]:
        """Watch one life's ranks until it ends: the status to leave with, and the restart notice (or None)."""
        ended: dict[int, int] = {}  # rank: status, in the order they were seen to end
        may_restart = in_place < self.setup.limit
        lost_before = self.link.lost() if self.link is not None else (0, [], [])
        self._gone_before = self.link.gone() if self.link is not None else 0
        while True:
            _reap(children, ended)
            if self.standby is not None and in_place < self.setup.limit:
                self.standby.tick()  # the next life's standbys, once this life's ranks have started
            if self.memory is not None:
                self.memory.tick()  # the ranks' newest copies in memory, each to another node
            failed = [(rank, code) for rank, code in ended.items() if code != 0]
            if failed or len(ended) == len(children):
                break
            if may_restart and self.stopping is None:
                notice = self.notice(in_place + 1) or self._restart_for_lost(in_place + 1, lost_before)
                if notice is not None:  # a hang's other ranks can say they are warm only once its ranks left
                    return self._end(children, ended, warm=True, patient=notice.failure_class == "hang"), notice
            if self.stopping is None and self._handed_over_for(_HANDOVER_GRACE_S):
                self.log.info("ending the ranks of node %s: this job's run goes on as job %s", self.setup.node_name,
                              self._successor)
                return self._end(children, ended), None  # as scontrol requeue would: none waits out its peers
            time.sleep(_POLL_S)
        if not failed:
            return 0, None
        rank, code = self._cause_first(failed, oom_before)
        if not may_restart or self.stopping is not None or self._handed_over():
            if not may_restart and self._cause(rank, code, oom_before) is not None:
                self.log.info("no in-place restart left (retry.in_place = %d): leaving with status %d for the "
                              "retry policy", self.setup.limit, code)
            return self._leave(children, ended, code), None
        notice = self._restart_for(children, ended, rank, code, oom_before, in_place + 1)
        if notice is None:
            _rank, code = self._cause_first([(r, c) for r, c in ended.items() if c != 0], oom_before)
            return self._leave(children, ended, code), None
        return self._end(children, ended, warm=True, patient=notice.failure_class == "hang"), notice

    def _spawn(self, argv: list[str], envs: dict[int, dict[str, str]]) -> Children:
        """Start the life's ranks, each on its share of the node's CPUs (as srun binds a task per rank)."""
        shares = cpu_shares(len(envs))
        children: Children = {}
        try:
            for index, (rank, env) in enumerate(sorted(envs.items())):
                share = shares[index] if shares else None
                children[rank] = child = self.standby.start(argv, env, share, rank) if self.standby else \
                    subprocess.Popen(argv, env=env)
                if shares:
                    with contextlib.suppress(OSError):
                        os.sched_setaffinity(child.pid, shares[index])
        except BaseException:
            self._end(children, {})
            raise
        if self.standby is not None:
            self.standby.schedule()
        return children

    def _cause_first(self, failed: list[tuple[int, int]], oom_before: int) -> tuple[int, int]:
        """The failed rank whose end says most (:meth:`_weight`), the first to end among equals."""
        return min(failed, key=lambda item: self._weight(*item, oom_before))

    def _weight(self, rank: int, code: int, oom_before: int) -> int:
        """0: an end a restart mends (killed, crashed, a network fault), as its own agent would have said first
        when each rank had one; 1: the program's own error or out of memory (no restart); 2: it only lost a peer."""
        cause = self._cause(rank, code, oom_before, quiet=True)
        return 1 if cause is None else 2 if cause[0] == "peer" else 0

    def _leave(self, children: Children, ended: dict[int, int], code: int) -> int:
        """Leave for good: with ``code`` (the deciding rank's) where it died of a signal, else with the highest
        status of the node's ranks that ended on their own, as srun reports a step. On Slurm's signal the other
        ranks got it too and are saving: they are waited for; otherwise they are ended, as srun's
        --kill-on-bad-exit ends the other nodes' ranks."""
        if self.stopping is None:
            if self._handed_over():  # the rank that handed the run on finishes its records first
                deadline = self._handed_at + _HANDOVER_GRACE_S
                while _reap(children, ended) < len(children) and time.monotonic() < deadline:
                    time.sleep(_POLL_S)
            self._end(children, ended)
        else:
            for rank, child in children.items():
                ended.setdefault(rank, child.wait())
        own = [status for status in ended.values() if status > 0]  # the ends the agent did not make
        return code if code < 0 or not own else max(own)

    def _end(self, children: Children, ended: dict[int, int], warm: bool = False, patient: bool = False) -> int:
        """End every rank still running (and what it started); the first failed status, else 0. ``warm``: a
        restart follows, and a rank whose process outlives the failure trains the next life in it (``patient``:
        the first such rank is waited for as long as where no standby is ready)."""
        if warm and self.standby is not None:
            self.standby.await_warm(children, ended, patient)
        for rank, child in children.items():
            if rank not in ended:
                self._kill(child)
        for rank, child in children.items():
            ended.setdefault(rank, child.wait())
        return next((code for code in ended.values() if code != 0), 0)

    def _restart_for(self, children: Children, ended: dict[int, int], rank: int, code: int, oom_before: int,
                     next_in_place: int) -> RestartNotice | None:
        """The notice that restarts the ranks after rank ``rank`` ended with ``code``, or None to leave."""
        cause = self._cause(rank, code, oom_before)
        if cause is None or cause[0] == "peer":  # maybe a consequence: wait for the cause's own notice
            deadline = time.monotonic() + (_PEER_CAUSE_WAIT_S if cause else _OWN_ERROR_WAIT_S)
            seen, weight = len(ended), self._weight(rank, code, oom_before)
            while time.monotonic() < deadline and self.stopping is None and not self._handed_over():
                notice = self.notice(next_in_place)
                if notice is not None:
                    return notice
                if self.link is not None and self.link.usable and self.link.gone() > self._gone_before:
                    break  # the peer's agent is gone with its node: no notice of its own will come
                if _reap(children, ended) > seen:  # a rank of this node ended meanwhile: its end may say more
                    seen = len(ended)
                    other, status = self._cause_first([(r, c) for r, c in ended.items() if c != 0], oom_before)
                    if self._weight(other, status, oom_before) < weight:  # at most twice: the weight falls
                        return self._restart_for(children, ended, other, status, oom_before, next_in_place)
                time.sleep(_POLL_S)
            if cause is None or self.stopping is not None or self._handed_over():
                return None
            cause = ("infrastructure", cause[1])
        notice = RestartNotice(next_in_place, rank, node_name(), cause[0], cause[1], time.time())
        if self.link is not None and self.link.usable:
            with contextlib.suppress(ControlError):
                return self.link.request(self.setup.run_dir, notice)
        return request_restart(self.setup.run_dir, self.attempt, notice)

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

    def notice(self, in_place: int) -> RestartNotice | None:
        """Restart ``in_place``'s notice: pushed by the coordinator (no file read), or from the run folder when
        the coordinator cannot be reached."""
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

    def _cause(self, rank: int, code: int, oom_before: int, quiet: bool = False) -> tuple[str, str] | None:
        """(class, why) of rank ``rank``'s end that a restart in place may mend; ("peer", why) when it only lost
        a peer; None when it may not (the program's error, out of memory, a stop)."""
        if code < 0:
            from hpc_train.failures.signal_deaths import SIGNAL_NAMES, signal_class

            if code == -signal.SIGKILL and self.oom_kills() > oom_before:
                if not quiet:
                    peak = memory_peak()  # the cgroup's OOM killer: the retry policy says what to change
                    self.log.error(format_host_oom(rank, peak.process_bytes, peak.cgroup_bytes, peak.limit_bytes))
                return None
            failure_class, _meaning = signal_class(-code)
            return failure_class, f"rank {rank} ended on {SIGNAL_NAMES.get(-code, f'signal {-code}')}"
        if code != EXIT_RESTART_IN_PLACE:
            return None
        error = self._rank_error(rank)
        return ("peer" if lost_its_peer(error) else "infrastructure"), error[:300] or "asked for a restart"

    def _rank_error(self, rank: int) -> str:
        """The error rank ``rank`` recorded in its node's error log (or, older, ``rank-N.error.json``), read as
        every run-folder record is: never through a link, bounded in size."""
        import json

        name = error_log_name(rank, self.setup.tasks_per_node)
        record = read_error_log(self.setup.run_dir / LOGS_DIR / name).get(rank)
        if record is not None:
            return str(record.get("error", ""))
        try:
            record = json.loads(read_record_text(rank_error_path(self.setup.run_dir, rank)) or "{}")
            return str(record.get("error", "")) if isinstance(record, dict) else ""
        except (ValueError, RecursionError):
            return ""

    def _kill(self, child: subprocess.Popen[Any] | RankProcess) -> None:
        if isinstance(child, RankProcess):  # a warm byte it wrote before the kill landed no longer counts
            child.kill()
        elif child.poll() is None:  # a reaped child's pid may be another process's by now
            kill_tree(child.pid)

    def end_everything_below(self) -> None:
        """No process the old ranks started (a data loader worker, a checkpoint stager) outlives them; the
        standby ranks and anything below them stay. Kills and reaps until none of the rest is alive (the subreaper
        reaps what the ranks left), never waiting for the standbys, which do not end."""
        keep = self.standby.pids if self.standby is not None else set()
        deadline = time.monotonic() + 10
        while True:
            left = descendants(os.getpid(), skip=keep, alive=True)
            for pid in left:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            try:
                while os.waitpid(-1, os.WNOHANG)[0]:
                    pass
            except ChildProcessError:
                return
            if not left or time.monotonic() > deadline:
                return
            time.sleep(0.05)

    def _wait_for_every_node(self, notice: RestartNotice) -> None:
        """The restart barrier: this node's ranks have ended; one arrival per node, over the coordinator."""
        setup, agents = self.setup, len(self.setup.nodes)
        if self.link is not None and self.link.usable:
            with contextlib.suppress(ControlError):
                why = self.link.barrier(notice.in_place, setup.member, agents, _BARRIER_S,
                                        lambda: self.stopping is not None)
                if why is None:
                    return
                self.log.error("in-place restart %d: %s; leaving the job to Slurm and the retry policy",
                               notice.in_place, why)
                raise SystemExit(1)
        mark_ready(setup.run_dir, self.attempt, notice.in_place, setup.node)
        deadline = time.monotonic() + _BARRIER_S
        while ready_count(setup.run_dir, self.attempt, notice.in_place, agents) < agents:
            if time.monotonic() > deadline or self.stopping is not None:
                self.log.error("in-place restart %d: not every node's agent ended its ranks within %.0f s (a node "
                               "lost?); leaving the job to Slurm and the retry policy", notice.in_place, _BARRIER_S)
                raise SystemExit(1)
            time.sleep(0.1)

    def record(self, notice: RestartNotice) -> None:
        """Node 0's agent (or the one that decided, with spares): the attempt that ended says why and that it
        restarted in place."""
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


def _reap(children: Children, ended: dict[int, int]) -> int:
    """Note every rank that has ended since the last look; how many have."""
    for rank, child in children.items():
        if rank not in ended and (code := child.poll()) is not None:
            ended[rank] = code
    return len(ended)


def rank_command(run_dir: Path) -> list[str]:
    return [sys.executable, "-u", "-m", "hpc_train.launch", str(run_dir)]  # unbuffered, as srun lines run python


def supervise(setup: AgentSetup, argv: list[str] | None = None) -> int:
    """Run the rank of ``setup.run_dir`` (or ``argv``) under an agent; the status to leave with."""
    agent = Agent(setup)
    agent.take_signals()
    try:
        code = agent.run(argv or rank_command(setup.run_dir))
    finally:
        if agent.standby is not None:
            agent.standby.close()
        if agent.memory is not None:
            agent.memory.close()
        if agent.link is not None:
            agent.link.close()  # says bye: the coordinator does not take this agent for lost
    return leave_like(code)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) == 3 and args[0] == "--settle" and args[2].isdigit():
        from hpc_train.rank.agent.spares import settle

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
