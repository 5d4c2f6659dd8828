"""The health checks on rank 0's logged steps: each trips with its figure, threshold, cause and fix, is said once in
the log when it trips and once when it clears, and health.json holds the state now; other ranks keep nothing."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from hpc_train.rank.runtime.health import HealthCheck, Thresholds


def _check(tmp_path: Path, **limits: float) -> tuple[HealthCheck, list[str]]:
    lines: list[str] = []
    return HealthCheck(tmp_path, Thresholds(**limits, num_workers=0), lines.append,  # type: ignore[arg-type]
                       min_write_s=0), lines


def _findings(tmp_path: Path) -> list[dict[str, object]]:
    return json.loads((tmp_path / "health.json").read_text())["findings"]


def test_a_starved_loader_trips_once_names_the_fix_and_clears(tmp_path: Path) -> None:
    health, lines = _check(tmp_path)
    health.observe(10, {"loss": 3.0, "data_share": 0.1})
    assert lines == [] and not (tmp_path / "health.json").exists()
    health.observe(20, {"loss": 3.0, "data_share": 0.55})
    health.observe(30, {"loss": 3.0, "data_share": 0.6})  # still tripped: not said again
    assert lines == ["health: data_wait at step 20: 55% of the step waits for data (threshold 30%); likely a loader "
                     "that does not keep up (samples loaded or decoded in the training process, too few workers); "
                     "fix: raise data.num_workers (now 0) and data.prefetch_factor; on GPUs set data.pin_memory = "
                     "true"]
    assert [f["check"] for f in _findings(tmp_path)] == ["data_wait"]
    health.observe(40, {"loss": 3.0, "data_share": 0.05})
    assert lines[-1] == "health: data_wait cleared at step 40" and _findings(tmp_path) == []
    history = json.loads((tmp_path / "health.json").read_text())["history"]
    assert [(h["step"], h["event"]) for h in history] == [(20, "tripped"), (40, "cleared")]


def test_a_nan_loss_and_a_spike_are_flagged(tmp_path: Path) -> None:
    health, lines = _check(tmp_path)
    for step, loss in enumerate([3.0, 2.9, 2.8, 2.7, 2.6], start=1):
        health.observe(step, {"loss": loss})
    health.observe(6, {"loss": 9.5})
    assert lines[-1].startswith("health: loss at step 6: loss 9.5 is 3.4x the mean of the last 5 logged")
    health.observe(7, {"loss": 2.5})
    health.observe(8, {"loss": math.nan})
    assert lines[-2:] == ["health: loss cleared at step 7", lines[-1]]
    assert "the loss is NaN or infinite" in lines[-1] and "lower train.lr" in lines[-1]
    health.observe(9, {"loss": None})  # metrics.jsonl's null: still not finite, not said twice
    assert sum("health: loss at" in line for line in lines) == 2


def test_memory_that_grows_at_every_logged_step_is_a_leak(tmp_path: Path) -> None:
    health, lines = _check(tmp_path)
    for step in range(1, 7):
        health.observe(step, {"loss": 3.0, "memory_bytes": 2**30 * (1 + 0.05 * step)})
    assert lines and "health: memory_growth at step 6: memory grew 24% over the last 5 logged steps" in lines[-1]
    (tmp_path / "flat").mkdir()
    flat, quiet = _check(tmp_path / "flat")
    for step in range(1, 12):
        flat.observe(step, {"loss": 3.0, "memory_bytes": 2**30 + (step % 2) * 2**20})  # up and down: no leak
    assert quiet == []


def test_a_straggler_is_folded_in_and_off_switches_and_other_ranks_keep_nothing(tmp_path: Path) -> None:
    health, lines = _check(tmp_path, data_share=0.0, loss_spike=0.0, memory_growth=0.0)
    health.straggler(50, (3, "n7", 2.4), 1.5)
    assert "health: straggler at step 50: rank 3 on n7 takes 2.4x the median forward time (threshold 1.5x)" in \
        lines[-1] and "hpc_train doctor on n7" in lines[-1]
    health.observe(60, {"loss": 3.0, "data_share": 0.9, "memory_bytes": 1})  # those checks are off
    health.straggler(60, None, 1.5)
    assert lines[-1] == "health: straggler cleared at step 60"
    other = HealthCheck(tmp_path / "other", Thresholds(), lines.append, writer=False)
    other.observe(1, {"loss": math.nan, "data_share": 0.9})
    assert not (tmp_path / "other").exists() and other.active == {}


def test_a_new_attempt_starts_clear(tmp_path: Path) -> None:
    health, _ = _check(tmp_path)
    health.observe(20, {"loss": 3.0, "data_share": 0.9})
    assert _findings(tmp_path)
    _check(tmp_path)  # the requeued attempt's rank 0
    assert _findings(tmp_path) == []


def test_a_gpu_that_idles_or_fills_is_flagged_with_the_cause_the_other_checks_name(tmp_path: Path) -> None:
    health, lines = _check(tmp_path)
    health.observe(10, {"loss": 3.0, "gpu_utilisation": 0.9, "gpu_memory_share": 0.5})
    assert lines == []
    health.observe(20, {"loss": 3.0, "gpu_utilisation": 0.25, "gpu_memory_share": 0.97})
    assert lines[0].startswith("health: gpu_utilisation at step 20: rank 0's GPU is busy 25% of the time "
                               "(threshold 70%); likely too little work per kernel")
    assert lines[1].startswith("health: gpu_memory at step 20: rank 0's GPU memory is 97% full (threshold 95%)")
    (tmp_path / "starved").mkdir()
    starved, said = _check(tmp_path / "starved")
    starved.observe(10, {"loss": 3.0, "data_share": 0.6, "gpu_utilisation": 0.2})
    assert "likely the loader starving the GPU" in said[-1] and said[0].startswith("health: data_wait")


def test_nvml_reads_the_gpu_or_is_skipped_with_one_note() -> None:
    from hpc_train.rank.runtime.nvml import GpuReadings

    lines: list[str] = []
    readings = GpuReadings(0, lines.append)  # the real nvidia-ml-py
    if Path("/proc/driver/nvidia").exists():  # a GPU node (scripts/gpu_check.sh): a real reading
        assert lines == [] and 0 <= readings.read()["gpu_utilisation"] <= 1
        return
    assert readings.read() == {}
    assert len(lines) == 1 and lines[0].startswith("health: the GPU utilisation and memory checks are skipped: "
                                                    "NVML could not start")


def test_a_program_s_records_are_checked_for_their_loss_and_their_timed_data_wait(tmp_path: Path) -> None:
    from hpc_train.rank.runtime.health import RecordHealth

    lines: list[str] = []
    checks = RecordHealth(HealthCheck(tmp_path, Thresholds(num_workers=-1), lines.append))
    checks.record({"step": 1, "loss": 2.0, "data_ms": 5.0, "step_time_s": 0.05})  # 10 % on data
    checks.record({"step": 2, "accuracy": 0.5})  # nothing a check reads
    assert lines == []
    checks.record({"step": 3, "loss": 2.0, "data_ms": 40.0, "step_time_s": 0.05})
    assert lines[-1].startswith("health: data_wait at step 3: 80% of the step waits for data")
    assert "give your DataLoader more num_workers" in lines[-1]
    checks.record({"step": 4, "loss": None})  # a NaN the program logged (metrics.jsonl's null)
    assert lines[-1].startswith("health: loss at step 4: the loss is NaN or infinite")
    assert {f["check"] for f in _findings(tmp_path)} == {"loss"}  # the data wait cleared: step 4 timed none


def test_a_program_logging_every_step_is_checked_at_its_logged_steps_and_at_once_for_a_nan(tmp_path: Path) -> None:
    """``every`` = monitor.log_every: the checks read the records the progress line shows, as the trainer's do,
    so a program that logs every step pays for a tenth of them; a NaN loss is flagged at its own step."""
    from hpc_train.rank.runtime.health import RecordHealth

    lines: list[str] = []
    checks = RecordHealth(HealthCheck(tmp_path, Thresholds(num_workers=-1), lines.append), every=10)
    for step in range(1, 10):
        checks.record({"step": step, "loss": 2.0, "data_ms": 45.0, "step_time_s": 0.05})  # 90 % on data
    assert lines == []  # not a logged step yet
    checks.record({"step": 10, "loss": 2.0, "data_ms": 45.0, "step_time_s": 0.05})
    assert lines[-1].startswith("health: data_wait at step 10: 90% of the step waits for data")
    checks.record({"step": 13, "loss": None})
    assert lines[-1].startswith("health: loss at step 13: the loss is NaN or infinite")


def test_a_check_that_flaps_around_its_threshold_rewrites_health_json_at_most_every_10_s(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """gloo's communication share on CPU ranks trips and clears the comm check at one logged step after another:
    the log says each change, health.json (four metadata operations a write) is rewritten at most every 10 s
    after the check's first trip, and a change still unwritten at the end is written by flush."""
    from hpc_train.rank.runtime import health as module

    now = [1000.0]
    monkeypatch.setattr(module.time, "monotonic", lambda: now[0])
    writes: list[list[str]] = []
    lines: list[str] = []
    health = HealthCheck(tmp_path, Thresholds(num_workers=0), lines.append)
    real_write = health._write
    monkeypatch.setattr(health, "_write", lambda: (writes.append(sorted(health.active)), real_write())[1])
    for step in range(1, 42):  # 4 logged steps a second, the share above and below 20 % in turn
        now[0] += 0.25
        health.observe(step, {"loss": 3.0, "comm_share": 0.3 if step % 2 else 0.1})
    assert len(lines) == 41 and lines[0].startswith("health: comm at step 1") and lines[1] == \
        "health: comm cleared at step 2"
    assert writes == [["comm"], ["comm"]]  # the first trip at once; 10 s later the state then (step 41)
    health.observe(42, {"loss": 3.0, "comm_share": 0.1})
    assert len(writes) == 2 and [f["check"] for f in _findings(tmp_path)] == ["comm"]  # cleared 0.25 s after
    health.flush()
    assert _findings(tmp_path) == []
    history = json.loads((tmp_path / "health.json").read_text())["history"]
    assert len(history) == 42


def test_a_change_waiting_its_turn_is_written_when_the_rank_leaves(tmp_path: Path) -> None:
    """The data wait trips (written at once) and clears a moment later (waits its turn): a rank that leaves then,
    through quick_exit (a finished rank's exit, a stop's ``leave_now``), writes the clear first."""
    import subprocess
    import sys

    code = ("import sys\nfrom pathlib import Path\nfrom hpc_train.run.quick_exit import leave_now\n"
            "from hpc_train.rank.runtime.health import HealthCheck, Thresholds\n"
            "health = HealthCheck(Path(sys.argv[1]), Thresholds(), print)\n"
            "health.observe(10, {'loss': 3.0, 'data_share': 0.9})\n"
            "health.observe(20, {'loss': 3.0, 'data_share': 0.1})\nleave_now(0)\n")
    result = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=60,
                            check=False)
    assert result.returncode == 0, result.stderr
    assert "health: data_wait cleared at step 20" in result.stdout and _findings(tmp_path) == []


def test_a_closed_check_leaves_no_hook_behind(tmp_path: Path) -> None:
    """A process that trains twice (the Python API, a test) keeps no earlier check alive for its quick exit."""
    from hpc_train.run import quick_exit

    before = len(quick_exit._ON_LEAVE)
    check = HealthCheck(tmp_path, Thresholds(), lambda _line: None)
    assert len(quick_exit._ON_LEAVE) == before + 1
    check.close()
    check.close()
    assert len(quick_exit._ON_LEAVE) == before


def test_a_share_hovering_at_its_threshold_trips_once_and_clears_once_when_it_really_falls(tmp_path: Path) -> None:
    """The quick start's gloo traffic measured 20-22 % against 20 %: it tripped and cleared six times in 200
    steps. Hysteresis: a tripped share check clears below three quarters of its threshold."""
    health, lines = _check(tmp_path)
    for step, share in enumerate((0.21, 0.19, 0.22, 0.18, 0.20, 0.23, 0.16), start=1):
        health.observe(step * 10, {"loss": 3.0, "comm_share": share})
    assert [line.split(" at step")[0] for line in lines] == ["health: comm"], lines
    health.observe(80, {"loss": 3.0, "comm_share": 0.14})
    assert lines[-1] == "health: comm cleared at step 80" and len(lines) == 2


def test_cpu_ranks_on_one_node_have_no_network_only_a_stuck_collective_to_flag(tmp_path: Path) -> None:
    """Loopback gloo between ranks sharing a node's cores takes 20-60 % of a step on its own: no finding; a
    collective that holds the step (an injected slow one: 96 %) still trips."""
    health = HealthCheck(tmp_path, Thresholds(gpus=False, network=False), print, min_write_s=0)
    health.observe(10, {"loss": 3.0, "comm_share": 0.6, "data_share": 0.6})
    assert [finding["check"] for finding in _findings(tmp_path)] == ["data_wait"]
    health.observe(20, {"loss": 3.0, "comm_share": 0.96, "data_share": 0.6})
    assert sorted(finding["check"] for finding in _findings(tmp_path)) == ["comm", "data_wait"]
