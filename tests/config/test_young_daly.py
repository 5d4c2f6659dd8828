"""The Young/Daly arithmetic of ``checkpoint.every_minutes = "auto"``: the interval, the job's failure rate and
the goodput a plan shows, checked against figures worked by hand."""

from __future__ import annotations

import math

import pytest

from hpc_train.config.young_daly import (
    duration,
    estimated_cost_s,
    goodput,
    hours,
    job_mtbf_s,
    plan_cadence,
    young_daly_s,
)


def test_the_interval_is_sqrt_of_twice_the_cost_times_the_mtbf() -> None:
    assert young_daly_s(2.0, 3600.0) == pytest.approx(120.0)  # sqrt(2 x 2 x 3600)
    assert young_daly_s(30.0, 6300 * 3600 / 2048) == pytest.approx(math.sqrt(2 * 30 * 11074.2), rel=1e-4)


def test_a_free_save_still_waits_a_second() -> None:
    assert young_daly_s(0.0, 3600.0) == 1.0


def test_the_job_fails_as_often_as_all_its_nodes_together() -> None:
    assert job_mtbf_s(6300.0, 1) == 6300 * 3600
    assert job_mtbf_s(6300.0, 64) == pytest.approx(6300 * 3600 / 64)
    assert job_mtbf_s(6300.0, 0) == 6300 * 3600  # never a division by zero


def test_goodput_counts_saves_lost_half_intervals_and_restarts() -> None:
    # tau 120 s, C 2 s, M 3600 s, R 60 s: waste = 2/120 + (60 + 60)/3600 = 0.01667 + 0.03333
    assert goodput(120.0, 2.0, 3600.0, 60.0) == pytest.approx(1 - 2 / 120 - 120 / 3600)
    assert goodput(120.0, 2.0, 3600.0, 7200.0) == 0.0  # restarts slower than failures: nothing is kept
    assert goodput(0.0, 2.0, 3600.0, 60.0) == 0.0


def test_the_optimum_beats_its_neighbours() -> None:
    cost, mtbf = 5.0, 4 * 3600.0
    best = young_daly_s(cost, mtbf)
    assert goodput(best, cost, mtbf, 60) > goodput(best / 2, cost, mtbf, 60)
    assert goodput(best, cost, mtbf, 60) > goodput(best * 2, cost, mtbf, 60)


def test_the_plan_compares_restarts_in_place_with_requeues() -> None:
    cadence = plan_cadence("auto", 10.0, True, 6300.0, 64, 30.0)
    mtbf = 6300 * 3600 / 64
    assert cadence.mode == "auto" and cadence.cost_measured
    assert cadence.interval_s == pytest.approx(math.sqrt(2 * 10 * mtbf))
    assert cadence.restart_requeue_s == cadence.restart_in_place_s + 1800
    assert cadence.goodput_in_place > cadence.goodput_requeue
    assert cadence.goodput_in_place - cadence.goodput_requeue == pytest.approx(1800 / mtbf)


def test_fixed_minutes_are_taken_as_written() -> None:
    cadence = plan_cadence(12.5, 3.0, False, 6300.0, 8, 0.0)
    assert cadence.mode == "fixed" and cadence.interval_s == 750.0
    assert cadence.goodput_in_place == cadence.goodput_requeue  # no queue wait: both restart alike


def test_the_guessed_cost_scales_with_the_model_and_not_the_nodes_share() -> None:
    sync_one = estimated_cost_s(1_000_000_000, 1, async_save=False)
    assert sync_one == pytest.approx(16.0)  # 16 GB at 1 GB/s
    assert estimated_cost_s(1_000_000_000, 16, async_save=False) == pytest.approx(1.0)
    assert estimated_cost_s(1_000_000_000, 1, async_save=True) == pytest.approx(1.6)
    assert estimated_cost_s(10, 1, async_save=True) == 0.1  # never free


def test_figures_read_as_people_say_them() -> None:
    assert duration(45) == "45 s" and duration(750) == "12.5 min" and duration(9360) == "2.6 h"
    assert hours(6300 * 3600 / 4) == "1,575 h" and hours(9000) == "2.5 h"
