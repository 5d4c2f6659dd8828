"""When the built-in trainer's next save falls due under ``checkpoint.every_minutes``. Rank 0 turns minutes
into a number of steps from the step time it measures, and from the save cost it measures for ``"auto"``
(:mod:`hpc_train.config.young_daly`). The checkpoint transaction sends that step to every rank, so all ranks save
at the same step. The decision is made twice: once early in the attempt, and again after every save, so the
interval follows what the run measures."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

from hpc_train.config.young_daly import duration, hours, job_mtbf_s, young_daly_s

__all__ = ["PROBE_STEPS", "SaveCadence"]

PROBE_STEPS = 10  # steps of an attempt timed before the first decision
_COSTS_KEPT = 5  # the interval follows the mean of the last few saves


class SaveCadence:
    """Rank 0's clock for the saves: the steps since the last decision, what they took, and what saves cost."""

    def __init__(self, every_minutes: float | str, node_mtbf_hours: float, nodes: int,
                 measured_cost_s: float | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.auto = every_minutes == "auto"
        self.fixed_s = 0.0 if self.auto else float(every_minutes) * 60.0
        self.mtbf_s = job_mtbf_s(node_mtbf_hours, nodes)
        self.costs: deque[float] = deque([measured_cost_s] if measured_cost_s is not None else [], _COSTS_KEPT)
        self.clock = clock
        self.since: float | None = None  # the first step is not timed: it holds the warm-up (and the resume)
        self.steps = 0
        self.step_s = 0.0  # the mean step time of the last timed window
        self.interval_s = 0.0

    def stepped(self) -> None:
        """One more step done since the last decision."""
        if self.since is None:
            self.since = self.clock()
            return
        self.steps += 1

    def saved(self, seconds: float) -> None:
        """A save took ``seconds`` of the steps' time. The steps before it keep their mean (the save left out),
        and the steps after it are timed afresh."""
        now = self.clock()
        self.costs.append(seconds)
        if self.since is not None and self.steps:
            self.step_s = max(0.0, now - seconds - self.since) / self.steps
        self.since, self.steps = now, 0

    @property
    def cost_s(self) -> float | None:
        return sum(self.costs) / len(self.costs) if self.costs else None

    def steps_to_next(self) -> int:
        """Steps from now to the next save: the interval over the mean step time since the last decision.
        ``"auto"`` without a timed save asks for one at once (1), so that the next decision has a cost."""
        cost = self.cost_s
        if self.auto and cost is None:
            self.interval_s = 0.0
            return 1
        self.interval_s = young_daly_s(cost or 0.0, self.mtbf_s) if self.auto else self.fixed_s
        if self.steps and self.since is not None:
            self.step_s = (self.clock() - self.since) / self.steps
        return max(1, round(self.interval_s / max(self.step_s, 1e-6)))

    def describe(self, steps: int) -> str:
        """The decision as the rank-0 log says it."""
        if self.auto and self.cost_s is None:
            return "checkpoint cadence: a save now, to time one (checkpoint.every_minutes = \"auto\")"
        why = (f'auto: sqrt(2 x {self.cost_s:.3g} s a save x {hours(self.mtbf_s)} between failures)'
               if self.auto else "checkpoint.every_minutes")
        return f"checkpoint cadence: every {steps} steps (~{duration(self.interval_s)}; {why})"
