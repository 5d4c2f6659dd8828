"""What a rank's run returns, typed: the smoke test's check, a program's end, the trainer's summary, or a stop
after Slurm's signal. The producers hand back plain dicts (the JSON rank 0 writes into the run folder, and what
submitit's ``job.result()`` gives a user); every reader on the rank side reads them through :func:`rank_result`,
so a key is named in one place."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from hpc_train.run.paths import PROGRAM_FILE, SMOKE_FILE, TRAIN_FILE

__all__ = ["ProgramResult", "RankResult", "SmokeResult", "Stopped", "TrainResult", "rank_result"]


@dataclass(frozen=True)
class Stopped:
    """Saved after Slurm's signal: the step, the signal, what follows (``requeue``) and the agreed status."""

    step: int
    signal: str
    requeue: str
    reason: str
    exit_code: int


@dataclass(frozen=True)
class SmokeResult:
    all_reduce: float
    expected: float
    backend: str
    rendezvous: str
    groups: bool
    file = SMOKE_FILE

    def summary(self) -> str:
        return (f"smoke: all_reduce of ranks = {self.all_reduce} (expected {self.expected}) over {self.backend}, "
                f"rendezvous {self.rendezvous}; groups {'checked' if self.groups else 'not checked'}")


@dataclass(frozen=True)
class ProgramResult:
    program: str
    step: int | None
    file = PROGRAM_FILE

    def summary(self) -> str:
        return f"program {self.program} completed" + (f" after step {self.step}" if self.step is not None else "")


@dataclass(frozen=True)
class TrainResult:
    start_step: int
    steps: int
    final_loss: float
    eval_loss: float  # nan: no evaluation ran (eval off, or none was due)
    file = TRAIN_FILE

    def summary(self) -> str | None:
        if self.steps <= self.start_step:
            return None  # resumed at the last step: nothing trained in this attempt
        line = f"trained steps {self.start_step + 1}-{self.steps}: loss {self.final_loss:.4f}"
        return line + (f", eval loss {self.eval_loss:.4f}" if math.isfinite(self.eval_loss) else "")


RankResult = SmokeResult | ProgramResult | TrainResult


def rank_result(result: dict[str, Any]) -> RankResult | Stopped:
    """The typed form of what a rank's run returned."""
    if "stopped" in result:
        stopped = result["stopped"]
        return Stopped(stopped["step"], stopped["signal"], stopped["requeue"], stopped["reason"],
                       stopped["exit_code"])
    if "all_reduce" in result:
        return SmokeResult(result["all_reduce"], result["expected"], result["backend"], result["rendezvous"],
                           bool(result["groups"]))
    if "program" in result:
        return ProgramResult(result["program"], result.get("step"))
    return TrainResult(result["start_step"], result["steps"], result["final_loss"], result["eval_loss"])
