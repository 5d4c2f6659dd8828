"""A rank's result read through one typed reader: which file rank 0 writes and the line it logs, for the smoke
test, a program, the trainer and a stop after Slurm's signal (the producers' real dicts: tests/rank/)."""

from __future__ import annotations

import math

from hpc_train.run.paths import PROGRAM_FILE, SMOKE_FILE, TRAIN_FILE
from hpc_train.run.results import ProgramResult, SmokeResult, Stopped, TrainResult, rank_result


def test_each_kind_of_result_names_its_file_and_its_line() -> None:
    smoke = rank_result({"rank": 0, "all_reduce": 6.0, "expected": 6.0, "backend": "gloo", "rendezvous": "n1:29500",
                         "groups": {"tp": [0, 1]}, "hosts": ["n1"]})
    assert isinstance(smoke, SmokeResult) and smoke.file == SMOKE_FILE
    assert smoke.summary() == "smoke: all_reduce of ranks = 6.0 (expected 6.0) over gloo, rendezvous n1:29500; " \
                              "groups checked"
    program = rank_result({"rank": 0, "program": "loop.py:main", "step": None})
    assert isinstance(program, ProgramResult) and program.file == PROGRAM_FILE
    assert program.summary() == "program loop.py:main completed"
    after = rank_result({"program": "loop.py:main", "step": 40})
    assert after.summary() == "program loop.py:main completed after step 40"
    trained = rank_result({"rank": 0, "steps": 20, "start_step": 10, "final_loss": 2.5, "eval_loss": math.nan})
    assert isinstance(trained, TrainResult) and trained.file == TRAIN_FILE
    assert trained.summary() == "trained steps 11-20: loss 2.5000"
    assert rank_result({"steps": 20, "start_step": 10, "final_loss": 2.5, "eval_loss": 2.25}).summary() == \
        "trained steps 11-20: loss 2.5000, eval loss 2.2500"
    assert rank_result({"steps": 20, "start_step": 20, "final_loss": 0.0, "eval_loss": math.nan}).summary() is None


def test_a_stop_is_read_before_anything_else_the_result_holds() -> None:
    stopped = rank_result({"rank": 1, "program": "loop.py:main", "step": 7, "stopped": {
        "signal": "SIGUSR2", "step": 7, "requeue": "scontrol", "exit_code": 0, "reason": "scontrol requeue 42"}})
    assert stopped == Stopped(7, "SIGUSR2", "scontrol", "scontrol requeue 42", 0)
