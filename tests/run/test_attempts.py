"""attempts.jsonl: one line per attempt, a killed attempt recognised as such, and the lead time it implies."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hpc_train.run.attempts import Attempt, AttemptLog, recommended_lead_seconds, requeues_so_far


def test_an_attempt_is_written_when_it_starts_and_rewritten_when_it_ends(tmp_path: Path) -> None:
    log = AttemptLog(tmp_path)
    first = log.begin(job_id="7", restart=0, host="n1", started=1.0, start_step=0)
    assert [a.outcome for a in log.read()] == ["running"]
    log.finish(first, outcome="preempted", end_step=12, requeued=True, signal="SIGUSR2", ended=2.0)
    second = log.begin(job_id="7", restart=1, host="n2", started=3.0, start_step=12)
    log.finish(second, outcome="completed", end_step=40, ended=4.0)
    lines = [json.loads(line) for line in (tmp_path / "attempts.jsonl").read_text().splitlines()]
    assert [(a["attempt"], a["outcome"], a["start_step"], a["end_step"]) for a in lines] == [
        (1, "preempted", 0, 12), (2, "completed", 12, 40)]
    assert requeues_so_far(log.read()) == 1
    assert requeues_so_far(log.read(), "7") == 1 and requeues_so_far(log.read(), "8") == 0  # a new submission


def test_attempt_numbers_stay_unique_past_a_torn_line(tmp_path: Path) -> None:
    log = AttemptLog(tmp_path)
    log.begin(job_id="7", restart=0, host="n1", started=1.0, start_step=0)
    log.begin(job_id="7", restart=1, host="n1", started=2.0, start_step=0)
    lines = (tmp_path / "attempts.jsonl").read_text().splitlines()
    (tmp_path / "attempts.jsonl").write_text(lines[0][:10] + "\n" + lines[1] + "\n")  # line 1 torn
    third = log.begin(job_id="7", restart=2, host="n1", started=3.0, start_step=0)
    assert third.attempt == 3 and [a.attempt for a in log.read()] == [2, 3]


def test_an_attempt_still_running_when_the_next_starts_was_killed(tmp_path: Path) -> None:
    log = AttemptLog(tmp_path)
    log.begin(job_id="7", restart=0, host="n1", started=1.0, start_step=0)  # then SIGKILL: no end written
    log.begin(job_id="7", restart=1, host="n1", started=2.0, start_step=10)
    assert [a.outcome for a in log.read()] == ["killed", "running"]


def test_torn_and_foreign_lines_are_skipped(tmp_path: Path) -> None:
    log = AttemptLog(tmp_path)
    log.begin(job_id="7", restart=0, host="n1", started=1.0, start_step=0)
    with (tmp_path / "attempts.jsonl").open("a") as handle:
        handle.write('{"attempt": 2, "job_id"\n[1, 2]\n')
    assert len(log.read()) == 1


def test_an_unknown_outcome_is_refused(tmp_path: Path) -> None:
    log = AttemptLog(tmp_path)
    current = log.begin(job_id="7", restart=0, host="n1", started=1.0, start_step=0)
    with pytest.raises(ValueError, match="outcome must be one of"):
        log.finish(current, outcome="paused")


def _attempt(step: float | None, save: float | None) -> Attempt:
    return Attempt(attempt=1, job_id="1", restart=0, host="n", started=0.0, start_step=0, step_s_max=step,
                   save_s_max=save)


@pytest.mark.parametrize(("attempts", "floor", "lead"), [
    ([], 60, 60),                                   # nothing measured: the configured lead
    ([_attempt(1.0, 4.0)], 60, 60),                 # 3 + 6 + 10 = 19 s fits in 60
    ([_attempt(30.0, 40.0)], 60, 160),              # 90 + 60 + 10
    ([_attempt(30.0, None), _attempt(5.0, 80.0)], 60, 220),  # the slowest step and the slowest save
])
def test_recommended_lead_seconds(attempts: list[Attempt], floor: int, lead: int) -> None:
    assert recommended_lead_seconds(attempts, floor) == lead


def test_bad_lines_are_skipped_with_a_warning_naming_the_file_and_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    log = AttemptLog(tmp_path)
    good = log.begin("7", 0, "n1", 100.0, 0)
    with open(log.path, "ab") as handle:
        handle.write(b'[1, 2]\n{"attempt": "x", "job_id": "7", "restart": 0, "host": "n", "started": 1, '
                     b'"start_step": 0}\n\xff\xfe\x00\n{"attempt": 3, "job_id": "7", "restart": 0, "host": "n", '
                     b'"started": NaN, "start_step": 0}\n')
    assert log.read(warn=True) == [good]
    err = capsys.readouterr().err
    assert f"{log.path}:2: is not a JSON object" in err and f"{log.path}:3: \"attempt\" is 'x'" in err
    assert f"{log.path}:5: \"started\"" in err and "\x00" not in err
    assert log.read() == [good] and capsys.readouterr().err == ""  # quiet for the ranks


@pytest.mark.parametrize(("field", "value"), [("attempt", "1" + "0" * 400), ("started", "1e308"),
                                              ("ended", "1e308"), ("step_s_max", "1e308"), ("started", "NaN"),
                                              ("end_step", "9" * 5000), ("save_s_max", "-5")])
def test_a_number_out_of_range_is_a_damaged_line_skipped_by_name(tmp_path: Path, capsys: pytest.CaptureFixture,
                                                                  field: str, value: str) -> None:
    log = AttemptLog(tmp_path)
    log.begin("1", 0, "n1", 1700000000.0, 0)
    good = (tmp_path / "attempts.jsonl").read_text()
    bad = json.dumps({**json.loads(good), "attempt": 2, field: 0}).replace(f'"{field}": 0', f'"{field}": {value}')
    (tmp_path / "attempts.jsonl").write_text(good + bad + "\n")
    assert [a.attempt for a in log.read(warn=True)] == [1]
    assert "attempts.jsonl:2:" in capsys.readouterr().err
    assert recommended_lead_seconds(log.read(), 30) == 30  # 1e308 never reaches math.ceil


def test_a_huge_line_does_not_hide_the_attempts_after_it(tmp_path: Path) -> None:
    log = AttemptLog(tmp_path)
    log.begin("1", 0, "n1", 1700000000.0, 0)
    line = (tmp_path / "attempts.jsonl").read_text()
    (tmp_path / "attempts.jsonl").write_text(line + "x" * (20 << 20) + "\n" + line.replace('"attempt": 1',
                                                                                          '"attempt": 2'))
    assert [a.attempt for a in log.read()] == [1, 2]
