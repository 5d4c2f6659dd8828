"""How often to checkpoint, from how often the job fails: Young's interval sqrt(2 C M), which is Daly's
first-order optimum, from the save cost C and the job's mean time between failures M. Also the goodput that
interval buys when failures are restarted inside the job and when they are requeued. This is pure arithmetic:
the plan shows it (``checkpoint.every_minutes = "auto"``) and the ranks apply it to the saves they time.

Sources: J. W. Young, "A first order approximation to the optimum checkpoint interval", CACM 17(9), 1974;
J. T. Daly, "A higher order estimate of the optimum checkpoint interval for restart dumps", FGCS 22(3), 2006.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["Cadence", "duration", "estimated_cost_s", "goodput", "hours", "job_mtbf_s", "plan_cadence", "young_daly_s"]

# What a first-order model needs that a plan cannot measure. An attempt's start before its first step on a
# cluster (processes, imports, rendezvous, the checkpoint load) is about a minute; the local cluster's is 6 s.
START_S = 60.0
# A plan's guess at a save before the run has timed one: a checkpoint holds about 16 bytes a parameter (weights,
# fp32 master copy, two Adam moments). Each node writes its share at 1 GB/s to a parallel file system, or copies
# it to host memory at 10 GB/s when the save is asynchronous (what the step waits for).
_BYTES_PER_PARAMETER = 16
_WRITE_BYTES_PER_S_PER_NODE = 1e9
_STAGE_BYTES_PER_S_PER_NODE = 1e10
_SHORTEST_INTERVAL_S = 1.0


def duration(seconds: float) -> str:
    """An interval as people say it: "45 s", "12.5 min", "2.6 h"."""
    if seconds < 120:
        return f"{seconds:.3g} s"
    return f"{seconds / 60:.3g} min" if seconds < 7200 else f"{seconds / 3600:.3g} h"


def hours(seconds: float) -> str:
    """A mean time between failures as people say it: "1,575 h", "2.5 h", "0.01 h"."""
    value = seconds / 3600.0
    return f"{value:,.0f} h" if value >= 10 else f"{value:.3g} h"


def job_mtbf_s(node_mtbf_hours: float, nodes: int) -> float:
    """The job's mean time between failures: any one of its nodes failing ends an attempt."""
    return node_mtbf_hours * 3600.0 / max(1, nodes)


def young_daly_s(cost_s: float, mtbf_s: float) -> float:
    """The interval between saves that loses the least time, to first order: sqrt(2 C M)."""
    return max(_SHORTEST_INTERVAL_S, math.sqrt(2.0 * max(cost_s, 0.0) * max(mtbf_s, 0.0)))


def goodput(interval_s: float, cost_s: float, mtbf_s: float, restart_s: float) -> float:
    """The share of wall time spent on steps that are kept, to first order. Every interval pays one save
    (C / tau). Once per M, a failure loses half an interval of steps on average, plus the restart R."""
    if interval_s <= 0 or mtbf_s <= 0:
        return 0.0
    waste = cost_s / interval_s + (interval_s / 2.0 + restart_s) / mtbf_s
    return min(1.0, max(0.0, 1.0 - waste))


def estimated_cost_s(parameters: int, nodes: int, async_save: bool) -> float:
    """A plan's guess at what one save costs the steps, before the run has timed one."""
    per_node = parameters * _BYTES_PER_PARAMETER / max(1, nodes)
    return max(0.1, per_node / (_STAGE_BYTES_PER_S_PER_NODE if async_save else _WRITE_BYTES_PER_S_PER_NODE))


@dataclass(frozen=True)
class Cadence:
    """The plan's checkpoint cadence for ``every_minutes``: the interval, and the goodput it buys, inside the
    job and through the queue."""

    mode: str  # "auto" (Young/Daly) or "fixed" (every_minutes as written)
    interval_s: float
    cost_s: float
    cost_measured: bool  # timed by an earlier attempt of this run folder, not estimated
    mtbf_s: float
    restart_in_place_s: float
    restart_requeue_s: float
    goodput_in_place: float
    goodput_requeue: float


def plan_cadence(every_minutes: float | str, cost_s: float, cost_measured: bool, node_mtbf_hours: float,
                 nodes: int, queue_wait_minutes: float) -> Cadence:
    """The interval ``every_minutes`` asks for at this size, and its goodput. A restart inside the job costs
    an attempt's start. A requeue costs the same start plus the site's typical queue wait."""
    mtbf = job_mtbf_s(node_mtbf_hours, nodes)
    auto = every_minutes == "auto"
    interval = young_daly_s(cost_s, mtbf) if auto else float(every_minutes) * 60.0
    in_place, requeue = START_S, START_S + queue_wait_minutes * 60.0
    return Cadence("auto" if auto else "fixed", interval, cost_s, cost_measured, mtbf, in_place, requeue,
                   goodput(interval, cost_s, mtbf, in_place), goodput(interval, cost_s, mtbf, requeue))
