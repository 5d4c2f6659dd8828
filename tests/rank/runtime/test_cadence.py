"""Rank 0's save clock under ``checkpoint.every_minutes``: minutes become steps from the measured step time,
the save's own time is left out of it, and ``"auto"`` follows the saves it times."""

from __future__ import annotations

import math

from hpc_train.rank.runtime.cadence import SaveCadence


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _steps(cadence: SaveCadence, clock: Clock, count: int, step_s: float) -> None:
    for _ in range(count):
        clock.now += step_s
        cadence.stepped()


def test_fixed_minutes_become_steps_from_the_step_time() -> None:
    clock = Clock()
    cadence = SaveCadence(2.0, 6300.0, 4, clock=clock)
    _steps(cadence, clock, 10, 0.5)  # the first step is not timed: 9 steps of 0.5 s
    assert cadence.steps_to_next() == 240  # 120 s / 0.5 s
    assert "every 240 steps (~2 min; checkpoint.every_minutes)" in cadence.describe(240)


def test_the_first_step_holds_the_warm_up_and_is_not_timed() -> None:
    clock = Clock()
    cadence = SaveCadence(1.0, 6300.0, 1, clock=clock)
    clock.now += 30.0  # compile, resume
    cadence.stepped()
    _steps(cadence, clock, 9, 1.0)
    assert cadence.steps_to_next() == 60


def test_auto_saves_at_once_to_time_a_save_then_follows_young_daly() -> None:
    clock = Clock()
    cadence = SaveCadence("auto", 1.0, 1, clock=clock)  # M = 3600 s
    _steps(cadence, clock, 10, 0.1)
    assert cadence.steps_to_next() == 1
    assert "to time one" in cadence.describe(1)
    _steps(cadence, clock, 1, 0.1)
    clock.now += 2.0  # the save
    cadence.saved(2.0)
    assert cadence.steps_to_next() == round(math.sqrt(2 * 2.0 * 3600) / 0.1)  # 120 s at 0.1 s a step
    assert "sqrt(2 x 2 s a save x 1 h between failures)" in cadence.describe(1200)


def test_a_slower_save_gives_a_longer_interval_and_the_save_is_not_a_step() -> None:
    intervals = []
    for save_s in (0.5, 8.0):
        clock = Clock()
        cadence = SaveCadence("auto", 2.0, 2, measured_cost_s=save_s, clock=clock)  # M = 3600 s
        _steps(cadence, clock, 10, 0.2)
        first = cadence.steps_to_next()
        clock.now += save_s
        cadence.saved(save_s)
        assert cadence.step_s == 0.2 or math.isclose(cadence.step_s, 0.2)
        intervals.append((first, cadence.steps_to_next()))
    (fast, _), (slow, _) = intervals
    assert fast == round(math.sqrt(2 * 0.5 * 3600) / 0.2)
    assert slow == round(math.sqrt(2 * 8.0 * 3600) / 0.2) and slow == 4 * fast


def test_an_earlier_attempts_save_time_is_the_start() -> None:
    clock = Clock()
    cadence = SaveCadence("auto", 1.0, 1, measured_cost_s=2.0, clock=clock)
    _steps(cadence, clock, 10, 1.0)
    assert cadence.steps_to_next() == 120
    assert cadence.cost_s == 2.0
