"""Failure classes: why one attempt of a run ended, from Slurm's accounting and the ranks' own evidence.

:func:`classify` is a pure function of a :class:`~hpc_train.backends.scheduler.SlurmRecord` (state, exit codes of the
allocation and its steps, reason, nodes) and an :class:`~hpc_train.failures.evidence.Evidence` (what
:func:`~hpc_train.failures.evidence.collect_evidence` read from the run folder: ``logs/rank-N.error.json``, this
attempt's part of each rank's lines in its node's ``logs/ranks-FIRST-LAST.log``, ``logs/stacks-rank-N.txt``, and
the batch output Slurm and srun wrote). The first rule that matches decides; the order is the point:

1. ``COMPLETED`` with status 0 everywhere: **completed**.
2. The scheduler saw a node die (``NODE_FAIL``, ``BOOT_FAIL``, "DUE TO NODE FAILURE"): **node_failure**, before
   the rank evidence: every surviving rank then shows a traceback that would read as a program error.
3. Slurm's preemption and time limit: ``PREEMPTED``, "DUE TO PREEMPTION" or hpc_train's status 144 (local
   requeue): **preempted**; ``TIMEOUT``, ``DEADLINE``, "DUE TO TIME LIMIT": **time_limit**. Slurm's verdict beats
   whatever the signalled ranks printed on the way out.
4. The cgroup out-of-memory killer (``OUT_OF_MEMORY`` on a step, "oom-kill" or srun's "Out Of Memory", the
   agent's peak line): **out_of_memory** (host memory; the killed rank leaves no traceback).
5. The first rank to fail with an error of its own (a *primary* error; earliest by its error file's time, then
   rank) decides: CUDA out of memory or ``MemoryError``: **out_of_memory**; a GPU or driver fault (ECC, illegal
   memory access, fallen off the bus, Xid) or a network fault (NCCL "unhandled system error", InfiniBand errors):
   **infrastructure** on that rank's node; any other exception: **user_error** on that rank. *Secondary* errors
   (NCCL / gloo timeouts, "connection closed by peer", aborted communicators) are what the other ranks see when
   one fails, so a NCCL timeout caused by one rank's exception is that rank's user error. ``SystemExit`` and
   ``KeyboardInterrupt`` are not primary.
6. The hang watchdog (status 77, ``logs/stacks-rank-N.txt``, an attempt recorded as ``hang``), a save that hung
   after a signal (status 76), or collective timeouts that no primary error explains: **hang**. Suspects: the
   ranks the watchdog named ("hang: rank N is not in a collective"), else those whose dumped main thread is
   outside torch.distributed / DeepSpeed comm, else those that reported no timeout while the others did. It
   comes after 5 because a rank that raised leaves the others waiting until something times out.
7. The run saved and stopped on a signal (status 75, "saved step N ... after SIGUSR2", attempt ``preempted``) or
   Slurm requeued it (``REQUEUED``): **preempted**, or **time_limit** when it ended within the smaller of 10
   minutes and 10 % of its time limit; with ``CANCELLED`` it is **cancelled** (scancel, which the run saved for).
8. ``CANCELLED`` with nothing above: **cancelled** (someone ran scancel; never retried).
9. A rank that ended on a signal without a traceback: **killed** (SIGKILL, SIGTERM) or **crashed** (SIGSEGV, ...).
10. Status 126/127 (command not found) or a launch error line ("hpc_train.launch: ..."): **user_error**.
11. Anything else: **unknown** (ranks that only lost their peers name the silent ranks' nodes, not excluded).

Suspect nodes are Slurm node names (what ``--exclude`` takes): a rank's host when it is one of the allocation's
nodes, else the node srun named for that task, else the allocation's node at the rank's node index.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Iterable
from dataclasses import asdict, dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from hpc_train.backends.scheduler import SlurmRecord
from hpc_train.common.hostlist import expand
from hpc_train.common.terminal import ranges as _ranges
from hpc_train.failures.evidence import SRUN_ERROR, Evidence, RankReport, srun_tasks, task_ranks
from hpc_train.failures.records import line_time
from hpc_train.failures.signal_deaths import oom_peaks, signal_class, signal_death
from hpc_train.run.exit_codes import (
    COMMAND_NOT_RUNNABLE,
    EXIT_HUNG,
    EXIT_SAVE_HUNG,
    EXIT_STOPPED,
    LOCAL_REQUEUE_EXIT,
)
from hpc_train.run.files import small_int
from hpc_train.run.loglines import LAUNCH_ERROR_PREFIX, NOT_IN_COLLECTIVE, RANK_LINE, parse_stop
from hpc_train.run.peer_errors import PEER_LOST
from hpc_train.run.stacks import in_collective

__all__ = ["CLASSES", "Classification", "classify", "is_hardware_fault"]

CLASSES = ("completed", "preempted", "time_limit", "node_failure", "infrastructure", "out_of_memory", "hang",
           "killed", "crashed", "user_error", "cancelled", "unknown")
_NEAR_LIMIT = 600.0  # an attempt that stopped this close to its limit (or 10 % of it, if less) met it

_GPU_OOM = re.compile(r"CUDA out of memory|OutOfMemoryError|CUDA error: out of memory|CUBLAS_STATUS_ALLOC_FAILED|"
                      r"cudaErrorMemoryAllocation|HIP out of memory")
_HOST_OOM = re.compile(r"oom[-_]kill|Out Of Memory|out-of-memory handler|OOM Killed")  # Slurm's and the kernel's
_PY_OOM = re.compile(r"\bMemoryError\b|Cannot allocate memory")  # a rank's own traceback: host memory
_HARDWARE = re.compile(r"uncorrectable ECC|ECC error|illegal memory access|fallen off the bus|\bXid\b|"
                       r"unspecified launch failure|NVLink|cudaErrorECCUncorrectable|CUDA error: unknown error|"
                       r"no CUDA-capable device|CUDA-capable device\(s\) is/are busy or unavailable|"
                       r"CUDA driver version is insufficient|CUDA error: uncorrectable")


def is_hardware_fault(text: str) -> bool:
    """Whether an error names a fault of the rank's own GPU or driver (ECC, Xid, fallen off the bus): the one
    infrastructure error whose node is surely the bad one. A network error shows on both ends of a link."""
    return bool(_HARDWARE.search(text))


_NETWORK = re.compile(r"unhandled system error|NET/IB|ibv_\w+ failed|IBV_WC_\w+|Transport retry count exceeded|"
                      r"unhandled cuda error|NCCL error.*internal error")
_TIMEOUT = re.compile(r"Watchdog caught collective operation timeout|collective operation timeout|NCCL timeout|"
                      r"Timeout\(ms\)=|Timed out waiting [0-9]+ ?ms|[Gg]loo.*[Tt]imed out|Socket Timeout|"
                      r"Application timeout caused pair closure")
_SECONDARY = PEER_LOST
_NOT_PRIMARY = re.compile(r"^(SystemExit|KeyboardInterrupt|GeneratorExit)\b")
_FRAME = re.compile(r'File "([^"]+)", line ([0-9]+)(?:, in (\S+))?')
_SLURM_DUE = re.compile(r"\*\*\* (?:JOB|STEP) \S+ ON (\S+) CANCELLED AT \S+(?: DUE TO ([A-Z ]+?))? \*\*\*")


@dataclass(frozen=True)
class Classification:
    """Why an attempt ended: a class from :data:`CLASSES`, one line that says why, and what showed it."""

    failure_class: str
    reason: str
    evidence: tuple[str, ...] = ()
    nodes: tuple[str, ...] = ()
    ranks: tuple[int, ...] = ()
    job_id: str = ""

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        return {"class": data.pop("failure_class"), **data}


# -- classification ------------------------------------------------------------------------------------------


class _Finding:
    """One rank's own diagnosis: primary (``out_of_memory``, ``infrastructure``, ``user_error``: its own failure),
    secondary (``timeout``, ``comms``: a symptom of another rank's), or ``none``; worked out when a rule first
    asks (the earliest primary decides: at 16,384 failed ranks the others' patterns never run)."""

    def __init__(self, report: RankReport) -> None:
        self.report = report
        self.when = report.error_time if report.error_time is not None else _first_error_time(report.log_tail)

    @cached_property
    def _found(self) -> tuple[str, str]:
        return _diagnose(self.report)

    @property
    def kind(self) -> str:
        return self._found[0]

    @property
    def text(self) -> str:
        return self._found[1]

    @property
    def said(self) -> bool:
        """``kind != "none"``; an error record's own exception decides it without the patterns."""
        return bool(self.report.error and not _NOT_PRIMARY.match(self.report.error)) or self.kind != "none"


_PRIMARY = ("out_of_memory", "infrastructure", "user_error")


@dataclass
class _Attempt:
    """Everything the rules look at, worked out once."""

    record: SlurmRecord | None
    evidence: Evidence
    down_nodes: frozenset[str]
    facts: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        record = self.record
        self.job_id = record.job_id if record else ""
        self.state = record.base_state if record else ""
        self.statuses = record.exit_statuses() if record else []
        self.codes = {rc for rc, _ in self.statuses}
        self.allocation = _nodes(record)
        batch = self.evidence.batch_log
        by_srun = all(r.launcher in ("", "srun") for r in self.evidence.ranks)  # srun's tasks: ranks, or nodes
        self.srun = task_ranks(srun_tasks(batch), self.evidence.ranks_per_task, self.evidence.ranks) if by_srun else {}
        self.srun_lines = [m[0] for m in SRUN_ERROR.finditer(batch)]
        self.due = [(m[1], (m[2] or "").strip()) for m in _SLURM_DUE.finditer(batch)]
        self.findings = [_Finding(report) for report in self.evidence.ranks]
        self.by_rank = {report.rank: report for report in self.evidence.ranks}
        self.stop = _stop_line(self.evidence)
        if record is not None:
            self.facts.append(_describe(record))

    def node_of(self, report: RankReport) -> str:
        """The Slurm node name of a rank: its host when that is an allocated node, else what srun said for its
        task, else the allocated node at its node index, else its host name."""
        short = report.host.split(".")[0]
        if short and short in self.allocation:
            return short
        if report.rank in self.srun:
            return self.srun[report.rank][0]
        if report.node_index is not None and 0 <= report.node_index < len(self.allocation):
            return self.allocation[report.node_index]
        return short

    def rank_node(self, rank: int) -> str:
        return self.node_of(self.by_rank.get(rank) or RankReport(rank))

    def silent_nodes(self) -> list[str]:
        """Nodes whose ranks said nothing while others reported errors: where a dead node's ranks were."""
        if not any(said := [f.said for f in self.findings]):
            return []
        loud = {self.node_of(f.report) for f, loud in zip(self.findings, said, strict=True) if loud}
        silent = [self.node_of(f.report) for f, loud in zip(self.findings, said, strict=True) if not loud]
        return list(dict.fromkeys(n for n in silent if n and n not in loud))

    def _stop_words(self) -> str:
        step, signal = self.stop or (None, "")
        return f"saved step {step} after {signal}" if step is not None else f"stopped on {signal} at an unknown step"

    def saved(self) -> str:
        return f" ({self._stop_words()})" if self.stop else ""

    def stop_fact(self) -> list[str]:
        return [f"rank log: {self._stop_words()}"] if self.stop else []

    def result(self, kind: str, reason: str, nodes: Iterable[str] = (), ranks: Iterable[int] = (),
               extra: Iterable[str] = ()) -> Classification:
        return Classification(kind, reason, tuple(dict.fromkeys([*self.facts, *extra])),
                              tuple(dict.fromkeys(n for n in nodes if n)), tuple(sorted(set(ranks))), self.job_id)


def classify(record: SlurmRecord | None, evidence: Evidence, down_nodes: Collection[str] = ()) -> Classification:
    """The failure class of one attempt; the first rule that matches decides (the order is in the module
    docstring). ``record``: the attempt's sacct record (None when there is none: local executor, no accounting).
    ``down_nodes``: nodes the scheduler reports DOWN or DRAINED now, when the caller asked ``sinfo``; they name
    the failed node of a ``NODE_FAIL`` that the ranks cannot."""
    attempt = _Attempt(record, evidence, frozenset(down_nodes))
    for rule in _RULES:
        found = rule(attempt)
        if found is not None:
            return found
    return _fallback(attempt)


def _completed(a: _Attempt) -> Classification | None:
    if a.state == "COMPLETED" and a.codes <= {0} and not any(f.kind in _PRIMARY for f in a.findings):
        return a.result("completed", f"completed: job {a.job_id} ended COMPLETED")
    return None


def _node_failure(a: _Attempt) -> Classification | None:
    due_nodes = [node for node, why in a.due if why == "NODE FAILURE"]
    if a.state not in ("NODE_FAIL", "BOOT_FAIL") and not due_nodes:
        return None
    suspects = [n for n in a.allocation if n in a.down_nodes] or due_nodes or a.silent_nodes()
    where = f" on {', '.join(suspects)}" if suspects else " (the failed node is not named; nothing to exclude)"
    why = "a node failed to boot" if a.state == "BOOT_FAIL" else "Slurm lost a node"
    return a.result("node_failure", f"node failure: {why}{where}; the ranks' errors follow from it", suspects,
                    extra=[f"slurm: {node} CANCELLED DUE TO NODE FAILURE" for node in due_nodes])


def _scheduler_stop(a: _Attempt) -> Classification | None:
    """Preemption and time limits as Slurm (or hpc_train's local requeue status) declares them."""
    due = {why for _, why in a.due}
    if a.state == "PREEMPTED" or LOCAL_REQUEUE_EXIT in a.codes or "PREEMPTION" in due:
        return a.result("preempted", f"preempted: job {a.job_id or '?'} was preempted{a.saved()}", extra=a.stop_fact())
    if a.state in ("TIMEOUT", "DEADLINE") or "TIME LIMIT" in due:
        what = "deadline" if a.state == "DEADLINE" else "time limit"
        return a.result("time_limit", f"time limit: job {a.job_id or '?'} reached its {what}{a.saved()}",
                        extra=a.stop_fact())
    return None


def _host_oom(a: _Attempt) -> Classification | None:
    """The cgroup out-of-memory killer: SIGKILL, no traceback; Slurm and slurmstepd say it."""
    steps = a.record.steps if a.record else ()
    lines = [line.strip() for line in a.evidence.batch_log.splitlines() if _HOST_OOM.search(line)]
    peaks = oom_peaks(a.evidence.ranks)  # the agents' own words, with the peak each rank reached
    if not (a.state == "OUT_OF_MEMORY" or any(s.state.startswith("OUT_OF_MEMORY") for s in steps) or lines or peaks):
        return None
    killed = {task: node for task, (node, _tasks, message) in a.srun.items() if _HOST_OOM.search(message)}
    nodes = [*killed.values(), *(m[1] for line in lines if (m := re.match(r"slurmstepd-(\S+?):", line)))]
    where = f" on {', '.join(dict.fromkeys(nodes))}" if nodes else ""
    return a.result("out_of_memory", f"out of memory: the node's memory limit killed a rank{where}"
                    f"{f' ({peaks})' if peaks else ''}; not retried unchanged: raise job.mem, lower "
                    "train.micro_batch or data.num_workers", nodes, killed, lines[:3])


def _first_rank_error(a: _Attempt) -> Classification | None:
    """The earliest rank with an error of its own; everything the other ranks reported follows from it."""
    ordered = sorted(a.findings, key=lambda f: (f.when, f.report.rank))  # the patterns run up to the first
    first = next((f for f in ordered if f.kind in _PRIMARY), None)
    if first is None:
        return None
    report = first.report
    node = a.node_of(report)
    others = [f.report.rank for f in a.findings if f is not first and f.said]
    extra = [f"rank {report.rank} ({node or '?'}): {_short(first.text)}"]
    if others:
        extra.append(f"rank {_ranges(others)} failed after it")
    on = f"rank {report.rank}" + (f" ({node})" if node else "")
    if first.kind == "out_of_memory":
        host = bool(_PY_OOM.search(first.text))
        fix = "ask for more host memory (job.mem) or lower train.micro_batch" if host else \
            "lower train.micro_batch, raise zero.stage or offload (python -m hpc_train validate --memory)"
        return a.result("out_of_memory", f"out of memory: {_short(report.error or first.text, 80)} on {on}; {fix}",
                        [node], [report.rank], extra)
    if first.kind == "infrastructure":
        return a.result("infrastructure", f"infrastructure: {_short(first.text, 100)} on {on}", [node],
                        [report.rank], extra)
    where = _location(report.traceback or "\n".join(report.log_tail))
    return a.result("user_error", f"user error: {_short(report.error or first.text, 100)} raised on {on}"
                    + (f" in {where}" if where else ""), [], [report.rank], extra)


def _hang(a: _Attempt) -> Classification | None:
    """The watchdog's verdict (status 77, stacks, an attempt recorded as hang), a hung save (76), or collective
    timeouts that no rank's own error explains."""
    stacks = [f.report for f in a.findings if f.report.stacks]
    timeouts = [f for f in a.findings if f.kind == "timeout"]
    watchdog = EXIT_HUNG in a.codes or bool(stacks) or a.evidence.outcome == "hang"
    if not (watchdog or EXIT_SAVE_HUNG in a.codes or timeouts):
        return None
    named = sorted({rank for f in a.findings for line in f.report.log_tail
                    if (m := NOT_IN_COLLECTIVE.search(line)) and (rank := small_int(m[1])) is not None})
    silent = [f.report.rank for f in a.findings if not f.said] if timeouts else []
    suspects = named or _stack_suspects(stacks) or silent
    nodes = list(dict.fromkeys(n for rank in suspects if (n := a.rank_node(rank))))
    if EXIT_SAVE_HUNG in a.codes and not watchdog:
        why = "hang: the checkpoint save after the signal did not finish in time (exit 76)"
    else:
        how = "the watchdog found no progress" if watchdog else \
            f"a collective timed out on rank {_ranges(f.report.rank for f in timeouts)}"
        who = ""
        if suspects:
            who = f"; rank {_ranges(suspects)}" + (" not in a collective" if named or stacks else
                                                  " reported no timeout (the others waited for it)")
        why = f"hang: {how}{who}" + (f" on {', '.join(nodes)}" if nodes else "")
    extra = [f"stacks dumped by rank {_ranges(r.rank for r in stacks)}"] if stacks else []
    if a.evidence.outcome == "hang" and a.evidence.note:
        extra.append(f"attempts.jsonl: {_short(a.evidence.note)}")
    extra += [f"rank {f.report.rank}: {_short(f.text)}" for f in timeouts[:3]]
    return a.result("hang", why, nodes, suspects, extra)


def _signalled_stop(a: _Attempt) -> Classification | None:
    """The run saved and stopped on a signal (status 75, "saved step N after SIG..."), or Slurm requeued it:
    preempted, or time limit when it ran to the end of its time; after scancel, cancelled."""
    if a.state == "CANCELLED" and a.stop is not None:
        return a.result("cancelled", f"cancelled: {_cancelled_by(a)}{a.saved()}", extra=a.stop_fact())
    if not (a.state == "REQUEUED" or EXIT_STOPPED in a.codes or a.stop is not None
            or a.evidence.outcome == "preempted"):
        return None
    if _near_limit(a.record):
        return a.result("time_limit", f"time limit: the run stopped near its time limit{a.saved()}",
                        extra=a.stop_fact())
    how = "requeued" if a.state == "REQUEUED" else "stopped"
    return a.result("preempted", f"preempted: the run was signalled and {how}{a.saved()}", extra=a.stop_fact())


def _cancelled(a: _Attempt) -> Classification | None:
    if a.state != "CANCELLED" and a.evidence.outcome != "cancelled":  # the latter: a local run's cancel
        return None
    return a.result("cancelled", f"cancelled: {_cancelled_by(a)}; no rank reported an error")


def _killed(a: _Attempt) -> Classification | None:
    """A rank that ended on a signal without a traceback: killed from outside, or crashed in native code."""
    if (death := signal_death(a.srun, a.evidence.ranks, a.node_of)) is not None:
        kind, words = signal_class(death.signal) if death.signal else ("killed", "killed: a signal srun did not name")
        return a.result(kind, f"{words}: rank {death.task} on {death.where} ended without a traceback "
                        f"({death.words.strip()})", [death.node] if death.node else [], [death.task], [death.line()])
    signals = [sig for _rc, sig in a.statuses if sig and sig != 15]
    signals += [rc - 128 for rc in a.codes if 128 < rc < 160 and rc != LOCAL_REQUEUE_EXIT]
    if not signals:
        return None
    kind, words = signal_class(signals[0])
    return a.result(kind, f"{words}: a process ended without a traceback")


def _could_not_start(a: _Attempt) -> Classification | None:
    launch = [line.strip() for line in a.evidence.batch_log.splitlines() if LAUNCH_ERROR_PREFIX in line]
    if not a.codes & COMMAND_NOT_RUNNABLE and not launch:
        return None
    detail = launch[0].split(LAUNCH_ERROR_PREFIX, 1)[1] if launch else \
        f"exit status {max(a.codes & COMMAND_NOT_RUNNABLE)}: a command was not found or not executable"
    return a.result("user_error", f"user error: the ranks could not start: {_short(detail, 120)}",
                    extra=launch[:2])


def _fallback(a: _Attempt) -> Classification:
    comms = [f for f in a.findings if f.kind == "comms"]
    if comms:
        silent = a.silent_nodes()
        return a.result("unknown", f"unknown: ranks lost their peers ({_short(comms[0].text, 60)}) but none reported "
                        "a cause" + (f"; silent ranks on {', '.join(silent)}" if silent else ""), silent,
                        extra=[f"rank {f.report.rank}: {_short(f.text)}" for f in comms[:3]])
    if a.record is None and not a.evidence.ranks:
        return a.result("unknown", "unknown: no accounting record and no rank evidence")
    status = ", ".join(f"{rc}:{sig}" for rc, sig in a.statuses) or "?"
    return a.result("unknown", f"unknown: job {a.job_id or '?'} ended {a.state or 'without a record'} (exit "
                    f"{status}) and no rank reported an error; see python -m hpc_train logs RUN_DIR",
                    extra=a.srun_lines[:3])


_RULES = (_completed, _node_failure, _scheduler_stop, _host_oom, _first_rank_error, _hang, _signalled_stop,
          _cancelled, _killed, _could_not_start)


def _diagnose(report: RankReport) -> tuple[str, str]:
    """Sort one rank's evidence into primary (its own failure) or secondary (a symptom of another's): (kind, the
    line that says it). Only error records of its log count: info lines (the fabric report, say) name NCCL things
    without anything being wrong."""
    text = "\n".join([report.error, report.traceback, *_error_records(report.log_tail), *report.stderr])
    error_line = report.error or _last_exception(report.traceback or text)
    for kind, pattern in (("out_of_memory", _GPU_OOM), ("out_of_memory", _PY_OOM), ("infrastructure", _HARDWARE),
                          ("timeout", _TIMEOUT), ("infrastructure", _NETWORK), ("comms", _SECONDARY)):
        if pattern.search(text):
            return kind, _matching_line(text, pattern) or error_line
    if error_line and not _NOT_PRIMARY.match(error_line):
        return "user_error", error_line
    return "none", error_line


def _error_records(lines: Iterable[str], lowest: str = "ERROR") -> list[str]:
    """The lines of log records at ``lowest`` level or above, continuation lines included."""
    levels = ("WARNING", "ERROR", "CRITICAL") if lowest == "WARNING" else ("ERROR", "CRITICAL")
    kept, keep = [], False
    for line in lines:
        m = RANK_LINE.match(line)
        if m:
            keep = m[2] in levels
        if keep:
            kept.append(line)
    return kept


def _cancelled_by(a: _Attempt) -> str:
    """Who cancelled: the user or the follower through hpc_train (with the reason), or a scancel's uid."""
    by = a.record.state.partition(" by ")[2] if a.record else ""
    if a.evidence.cancelled_by:
        return a.evidence.cancelled_by
    return f"scancel by uid {by}" if by else "the job was cancelled"


def _describe(record: SlurmRecord) -> str:
    steps = "; ".join(f"step {s.step} {s.state} {s.exit_code}" for s in record.steps if s.step not in ("extern",))
    reason = f", reason {record.reason}" if record.reason else ""
    return f"sacct: job {record.job_id} {record.state} exit {record.exit_code} on {record.nodes or '?'}{reason}" + \
        (f" ({steps})" if steps else "")


def _nodes(record: SlurmRecord | None) -> list[str]:
    if record is None or not record.nodes or record.nodes in ("None assigned", "(null)"):
        return []
    try:
        return expand(record.nodes)
    except ValueError:
        return []


def _stop_line(evidence: Evidence) -> tuple[int | None, str] | None:
    for report in evidence.ranks:
        for line in reversed(report.log_tail):
            if ("saved step " in line or "stopped " in line) and (stop := parse_stop(line)) is not None:
                return stop
    return None


def _near_limit(record: SlurmRecord | None) -> bool:
    return record is not None and record.elapsed_s is not None and record.limit_s is not None and \
        record.limit_s - record.elapsed_s <= min(_NEAR_LIMIT, 0.1 * record.limit_s)


def _stack_suspects(stacks: list[RankReport]) -> list[int]:
    """Ranks whose main thread (in the last dump of ``stacks-rank-N.txt``) is not inside torch.distributed or
    DeepSpeed's communication while the other ranks' are: the ones the others wait for."""
    outside = [r.rank for r in stacks if not in_collective(r.stacks)]
    return sorted(outside) if len(outside) < len(stacks) else []


def _last_exception(text: str) -> str:
    """The exception line that ends a traceback (``ValueError: bad``), or ''."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if not any("Traceback (most recent call last)" in line for line in lines):
        return ""
    for line in reversed(lines):
        if re.match(r"^[\w.]+(Error|Exception|Exit|Interrupt|Warning)\b|^[\w.]+: ", line):
            return line
    return lines[-1]


def _first_error_time(lines: Iterable[str]) -> float:
    """When a rank first logged an ERROR record (for ranks without an error file)."""
    for line in lines:
        m = RANK_LINE.match(line)
        if m and m[2] in ("ERROR", "CRITICAL"):
            return float("inf") if (stamp := line_time(line)) is None else stamp
    return float("inf")


def _matching_line(text: str, pattern: re.Pattern[str]) -> str:
    return next((line.strip() for line in text.splitlines() if pattern.search(line)), "")


def _location(traceback_text: str) -> str:
    """``distributed/faults.py:28``: the innermost frame, with the last two parts of its path."""
    frames = _FRAME.findall(traceback_text)
    if not frames:
        return ""
    return f"{'/'.join(Path(frames[-1][0]).parts[-2:])}:{frames[-1][1]}"


def _short(text: str, limit: int = 160) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit - 3] + "..."
