"""Each log line the login side parses: what the writer's formatter makes, the reader's parser reads back."""

from __future__ import annotations

import logging
import time

from hpc_train.run.loglines import (
    BATCH_START,
    LAUNCH_ERROR_PREFIX,
    NOT_IN_COLLECTIVE,
    RANK_LINE,
    RANK_RECORD,
    StartLine,
    format_host_oom,
    format_launch_error,
    format_not_in_collective,
    format_saved_after_signal,
    format_start,
    format_stopped,
    parse_host_oom,
    parse_start,
    parse_stop,
    rank_line_time,
    rank_log_format,
)


def _logged(rank: int, level: int, message: str) -> str:
    record = logging.LogRecord("hpc_train.rank3", level, __file__, 1, message, None, None)
    return logging.Formatter(rank_log_format(rank)).format(record)


def test_a_start_line_parses_back_inside_a_log_record() -> None:
    line = _logged(3, logging.INFO, format_start("srun", 3, 8, 1, 4, 0, 2, "4711_2", 1, "gpu017"))
    assert parse_start(line) == StartLine("srun", 3, 8, 0, 2, "4711_2", 1)
    assert parse_start("start: nothing like it") is None


def test_both_stop_lines_give_the_step_and_the_signal() -> None:
    saved = format_saved_after_signal(120, 3.25, "SIGUSR2", True, "scontrol requeue 42")
    assert saved == "saved step 120 3.2 s after SIGUSR2; requeued: scontrol requeue 42"
    assert parse_stop(_logged(0, logging.INFO, saved)) == (120, "SIGUSR2")
    assert "not requeued: " in format_saved_after_signal(1, 0.0, "SIGTERM", False, "why")
    stopped = format_stopped(7, "SIGTERM", "none", "preempt.requeue is false", 75)
    assert parse_stop(_logged(1, logging.INFO, stopped)) == (7, "SIGTERM")
    assert parse_stop("trained steps 1-7") is None


def test_the_watchdogs_suspect_line_names_the_rank() -> None:
    line = _logged(0, logging.INFO, format_not_in_collective(5, 'File "x.py", line 3 in spin'))
    m = NOT_IN_COLLECTIVE.search(line)
    assert m is not None and int(m[1]) == 5


def test_the_record_prefix_gives_level_rank_message_and_time() -> None:
    before = time.time()
    line = _logged(12, logging.ERROR, "failed:\nTraceback")
    m, record = RANK_LINE.match(line), RANK_RECORD.match(line.splitlines()[0])
    assert m is not None and m[2] == "ERROR"
    assert record is not None and (record[2], record[3], record[4]) == ("12", "ERROR", "failed:")
    stamp = rank_line_time(line)
    assert stamp is not None and before - 1 <= stamp <= time.time() + 1
    assert rank_line_time("no stamp here") is None


def test_the_launch_error_and_the_batch_start_line() -> None:
    assert format_launch_error("no rank found").removeprefix(LAUNCH_ERROR_PREFIX) == "no rank found"
    assert BATCH_START.match("hpc_train: job 42 restart 0 on n[1-2], rendezvous n1:29500")


def test_the_agents_out_of_memory_line_gives_the_rank_and_its_peaks() -> None:
    gib = 2**30
    assert parse_host_oom(format_host_oom(3, int(2.5 * gib), 4 * gib, 4 * gib)) == (3, 2.5, 4.0, 4.0)
    assert parse_host_oom(format_host_oom(0, gib, 2 * gib, None)) == (0, 1.0, 2.0, None)
    assert parse_host_oom(format_host_oom(1, gib, None, None)) == (1, 1.0, None, None)
    assert parse_host_oom("killed: SIGKILL from outside") is None
