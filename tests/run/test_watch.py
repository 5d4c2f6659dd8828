"""Readers that watch a live run: they see what rank 0 has written so far and never fail on a torn line."""

from __future__ import annotations

from pathlib import Path

from hpc_train.run.paths import METRICS_FILE
from hpc_train.run.watch import last_logged_step, local_rank_pid


def test_last_logged_step_reads_whole_lines_only(tmp_path: Path) -> None:
    assert last_logged_step(tmp_path) == 0
    (tmp_path / METRICS_FILE).write_text('{"step": 1, "loss": 2.0}\n{"step": 3, "loss": 1.5}\n{"step": 4, "lo')
    assert last_logged_step(tmp_path) == 3
    (tmp_path / METRICS_FILE).write_text('{"step": 2}\n[1, 2]\n{"eval_loss": 1.0}\n')
    assert last_logged_step(tmp_path) == 2


def test_no_rank_process_of_a_run_that_is_not_running(tmp_path: Path) -> None:
    assert local_rank_pid(tmp_path, 0) is None
