"""What ``python -m hpc_train plot`` draws, read from run folders: each metric against step from ``metrics.jsonl``,
and every attempt's start and end (preempted, requeued, failed, hung, killed) from ``attempts.jsonl``.

Plain Python, no matplotlib: the figure is drawn from exactly this (``plot --json`` prints it), so a test or a
person can check what a picture shows. A requeued run's metrics were already cut back to the resumed step by the
next attempt (``hpc_train.rank.runtime.monitor``), so each step appears once, from the attempt that trained it last.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from hpc_train.errors import ConfigError
from hpc_train.run.attempts import Attempt, AttemptLog
from hpc_train.run.files import finite, parse_json, record_lines, refuse_link, time_value, warn_bad_record
from hpc_train.run.paths import METRICS_FILE

__all__ = ["DEFAULT_PANELS", "Mark", "RunSeries", "read_run"]

# The panels drawn by default, each a list of metrics sharing an axis; only those a run logged are drawn.
DEFAULT_PANELS = (("loss", "eval_loss"), ("lr",), ("tokens_per_s",),
                  ("data_share", "forward_share", "backward_share", "optimizer_share", "comm_share"))
_NOT_METRICS = ("step", "time")
_ENDS = {"preempted": "preempted", "failed": "failed", "hang": "hung", "killed": "killed",
         "node_failure": "node failure", "infrastructure": "infrastructure fault"}


@dataclass(frozen=True)
class Mark:
    """An attempt's start or end at ``step``: ``kind`` is ``start`` or how it ended."""

    step: float
    attempt: int
    kind: str
    label: str


@dataclass
class RunSeries:
    """One run folder's metrics (name -> (steps, values)) and its attempt marks."""

    name: str
    series: dict[str, tuple[list[float], list[float]]] = field(default_factory=dict)
    marks: list[Mark] = field(default_factory=list)
    times: list[tuple[float, float]] = field(default_factory=list)  # (time, step) of each record

    def summary(self) -> dict[str, object]:
        return {"run": self.name, "points": {name: len(steps) for name, (steps, _) in sorted(self.series.items())},
                "marks": [mark.__dict__ for mark in self.marks]}


def _records(path: Path) -> list[dict[str, object]]:
    """Every metrics record, line by line: a line too long, torn, or holding a number out of range is skipped
    with a warning naming the file and line, and the records after it are still drawn."""
    records = []
    for number, line in record_lines(path):
        try:
            record = parse_json(line)  # NaN and 1e400 as None; a 400-digit integer is damage
        except ValueError as error:
            record, problem = None, f"is not a metrics record ({error})"
        else:
            problem = "is not a metrics record"
        if not isinstance(record, dict) or finite(record.get("step")) is None:
            if line.strip():
                warn_bad_record(path, number, problem)
            continue
        records.append(record)
    return records


def read_run(run_dir: Path) -> RunSeries:
    """The metrics and marks of ``run_dir``; ConfigError (exit 2) when it is no run folder or holds no metrics."""
    run_dir = Path(run_dir)
    refuse_link(run_dir)
    if not run_dir.is_dir():
        raise ConfigError("RUN_DIR", f"{run_dir} is not a folder", "give a run folder, like runs/tiny-gpt")
    metrics = run_dir / METRICS_FILE
    if not metrics.is_file() or metrics.is_symlink():
        raise ConfigError("RUN_DIR", f"{run_dir} has no {METRICS_FILE}",
                          "give a run folder that has logged a step (it holds plan.json and metrics.jsonl)")
    run = RunSeries(run_dir.name)
    for record in _records(metrics):
        step = float(record["step"])  # type: ignore[arg-type]  # _records kept only steps finite() takes
        if (moment := time_value(record.get("time"))) is not None:
            run.times.append((moment, step))
        for name, value in record.items():
            if name not in _NOT_METRICS and (number := finite(value)) is not None:
                steps, values = run.series.setdefault(name, ([], []))
                steps.append(step)
                values.append(number)
    if not run.series:
        raise ConfigError("RUN_DIR", f"{metrics} holds no metrics record",
                          "wait for the run's first logged step, or give another run folder")
    run.marks = _marks(AttemptLog(run_dir).read(warn=True), run.times)
    return run


def _step_at(times: list[tuple[float, float]], moment: float | None) -> float | None:
    """The step of the latest record logged at or before ``moment``."""
    if moment is None:
        return None
    before = [(when, step) for when, step in times if when <= moment]
    return max(before)[1] if before else None


def _marks(attempts: list[Attempt], times: list[tuple[float, float]]) -> list[Mark]:
    marks = []
    for index, attempt in enumerate(attempts):
        if index:
            marks.append(Mark(float(attempt.start_step), attempt.attempt, "start",
                              f"attempt {attempt.attempt} from step {attempt.start_step}"))
        if attempt.outcome not in _ENDS:
            continue
        step = float(attempt.end_step) if attempt.end_step is not None else _step_at(times, attempt.ended)
        if step is None:
            continue
        how = _ENDS[attempt.outcome] + (", requeued" if attempt.requeued else "")
        marks.append(Mark(step, attempt.attempt, attempt.outcome, f"attempt {attempt.attempt} {how}"
                          + (f" ({attempt.signal})" if attempt.signal else "")))
    return marks
