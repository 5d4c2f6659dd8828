"""The rank-0 monitor: metrics.jsonl records, smoothed throughput/ETA, rank gating, resume without duplicate
steps, and TensorBoard events read back with TensorBoard's own reader."""

from __future__ import annotations

import io
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from hpc_train.rank.runtime.monitor import Monitor, NullMonitor, format_duration, truncate_metrics
from hpc_train.run.paths import METRICS_FILE

STEP_KEYS = {"step", "loss", "lr", "grad_norm", "tokens_per_s", "mfu", "step_time_s", "memory_bytes", "time"}


def plain_console() -> tuple[Console, io.StringIO]:
    out = io.StringIO()
    return Console(file=out, force_terminal=False, width=80), out


def records(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / METRICS_FILE).read_text().splitlines()]


def run_steps(monitor: Monitor, steps: range, loss_offset: float = 0.0) -> None:
    for step in steps:
        # odd steps 0.5 s, even steps 1.5 s, 1000 tokens each
        monitor.step(step, loss=10.0 - step + loss_offset, lr=1e-3, grad_norm=0.5, tokens=1000,
                     step_time_s=0.5 if step % 2 else 1.5, memory_bytes=3 * 2**30)


def test_metrics_records_smoothed_over_the_log_window(tmp_path: Path) -> None:
    console, out = plain_console()
    with Monitor(tmp_path, total_steps=5, log_every=2, tensorboard=False, flops_per_token=1e6, peak_flops=1e10,
                 console=console) as monitor:
        run_steps(monitor, range(1, 6))
        monitor.eval(5, 4.5)
    lines = records(tmp_path)
    assert [r["step"] for r in lines] == [2, 4, 5, 5]  # every 2nd step, the last step, then the eval
    first = lines[0]
    assert set(first) == STEP_KEYS
    # steps 1+2: 2000 tokens in 0.5 + 1.5 s -> 1000 tok/s, not step 2's own 667
    assert first["tokens_per_s"] == pytest.approx(1000.0)
    assert first["step_time_s"] == pytest.approx(1.0)
    assert first["mfu"] == pytest.approx(1000 * 1e6 / 1e10)
    assert (first["loss"], first["lr"], first["grad_norm"], first["memory_bytes"]) == (8.0, 1e-3, 0.5, 3 * 2**30)
    assert lines[2]["tokens_per_s"] == pytest.approx(2000.0)  # step 5 alone: 1000 tokens in 0.5 s
    assert lines[3] == {"step": 5, "eval_loss": 4.5}
    text = out.getvalue().splitlines()
    assert len(text) == 4
    assert text[0] == ("step=2/5 loss=8.0000 lr=1.000e-03 grad_norm=0.500 tokens_per_s=1000 mfu=10.0% "
                       "mem_gib=3.00 eta=0:00:03")  # 3 steps left at 1.0 s each
    assert text[2].endswith("eta=0:00:00")
    assert text[3].startswith("eval step=5/5 eval_loss=4.5000")


def test_rich_line_on_a_terminal(tmp_path: Path) -> None:
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=200, color_system=None)
    with Monitor(tmp_path, total_steps=4, log_every=4, tensorboard=False, console=console) as monitor:
        run_steps(monitor, range(1, 5))
    text = out.getvalue()
    assert "step 4/4" in text and "tok/s" in text and "ETA 0:00:00" in text and "mem 3.0 GiB" in text
    assert "MFU n/a" in text  # no known peak: not a made-up percentage
    assert records(tmp_path)[0]["mfu"] == 0.0


def test_only_rank_zero_writes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    def never_iterated() -> Iterator[tuple[str, Any]]:
        raise AssertionError("other ranks must not touch the parameters")
        yield  # pragma: no cover

    run_dir = tmp_path / "run"
    kwargs: dict[str, Any] = {"run_dir": run_dir, "total_steps": 6, "log_every": 1, "tensorboard": True,
                              "histogram_every": 3}
    other = Monitor.create(1, **kwargs)
    assert isinstance(other, NullMonitor)
    with other:
        other.step(1, 1.0, 1e-3, 0.1, 100, 0.1)
        other.eval(1, 1.0)
        other.histograms(3, never_iterated())
    assert not run_dir.exists()
    assert capsys.readouterr() == ("", "")
    # the schedule is the same on every rank, so collectives tied to it stay in step
    assert [other.histograms_due(s) for s in range(1, 7)] == [False, False, True, False, False, True]
    assert all(other.log_due(s) for s in range(1, 7))

    console, _ = plain_console()
    with Monitor.create(0, **{**kwargs, "tensorboard": False}, console=console) as rank0:
        assert type(rank0) is Monitor
        rank0.step(1, 1.0, 1e-3, 0.1, 100, 0.1)
    assert [r["step"] for r in records(run_dir)] == [1]


def test_resume_drops_steps_after_the_checkpoint(tmp_path: Path) -> None:
    console, _ = plain_console()
    with Monitor(tmp_path, total_steps=10, log_every=1, tensorboard=False, console=console) as first:
        run_steps(first, range(1, 11))
        first.eval(5, 5.0)
        first.eval(10, 1.0)
    with (tmp_path / METRICS_FILE).open("a") as torn:
        torn.write('{"step": 11, "lo')  # a write cut short by the crash
    with Monitor(tmp_path, total_steps=10, log_every=1, tensorboard=False, start_step=6, console=console) as again:
        assert [r["step"] for r in records(tmp_path)] == [1, 2, 3, 4, 5, 6, 5]
        run_steps(again, range(7, 11), loss_offset=100.0)
    lines = records(tmp_path)
    train = [r["step"] for r in lines if "loss" in r]
    assert train == list(range(1, 11))  # no step twice
    assert [r["loss"] for r in lines if r["step"] > 6] == [103.0, 102.0, 101.0, 100.0]
    assert [r for r in lines if "eval_loss" in r] == [{"step": 5, "eval_loss": 5.0}]
    assert sorted(p.name for p in tmp_path.iterdir()) == [METRICS_FILE]  # no temp file left behind


def test_requeue_before_first_checkpoint_starts_over(tmp_path: Path) -> None:
    console, _ = plain_console()
    with Monitor(tmp_path, total_steps=4, log_every=1, tensorboard=False, console=console) as first:
        run_steps(first, range(1, 4))
    Monitor(tmp_path, total_steps=4, log_every=1, tensorboard=False, console=console).close()
    assert records(tmp_path) == []
    assert truncate_metrics(tmp_path / "absent.jsonl", 3) == 0


def test_record_without_its_newline_is_kept_and_ended(tmp_path: Path) -> None:
    (tmp_path / METRICS_FILE).write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.0}')
    console, _ = plain_console()
    with Monitor(tmp_path, total_steps=3, log_every=1, tensorboard=False, start_step=2, console=console) as monitor:
        run_steps(monitor, range(3, 4))
    assert [r["step"] for r in records(tmp_path)] == [1, 2, 3]


def test_non_finite_values_stay_strict_json(tmp_path: Path) -> None:
    console, out = plain_console()
    with Monitor(tmp_path, total_steps=1, log_every=1, tensorboard=False, console=console) as monitor:
        monitor.step(1, float("nan"), 1e-3, float("inf"), 10, 0.1)
        monitor.eval(1, float("nan"))
    text = (tmp_path / METRICS_FILE).read_text()
    assert "NaN" not in text and "Infinity" not in text
    step, evaluation = records(tmp_path)
    assert (step["loss"], step["grad_norm"], evaluation["eval_loss"]) == (None, None, None)
    assert "loss=nan" in out.getvalue()


def test_closed_monitor_refuses_and_close_is_idempotent(tmp_path: Path) -> None:
    console, _ = plain_console()
    monitor = Monitor(tmp_path, total_steps=2, log_every=1, tensorboard=False, console=console)
    monitor.close()
    monitor.close()
    with pytest.raises(RuntimeError, match="closed"):
        monitor.step(1, 1.0, 1e-3, None, 10, 0.1)
    with pytest.raises(ValueError, match="log_every"):
        Monitor(tmp_path, total_steps=2, log_every=0, tensorboard=False)


def test_missing_tensorboard_says_what_to_install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import now raises ImportError
    with pytest.raises(ImportError, match="pip install tensorboard"):
        Monitor(tmp_path, total_steps=2, tensorboard=True, console=plain_console()[0])


def test_format_duration() -> None:
    assert format_duration(3723.4) == "1:02:03"
    assert format_duration(2 * 86400 + 3 * 3600 + 4 * 60 + 5) == "2d 03:04:05"
    assert format_duration(float("inf")) == "?"


def test_tensorboard_scalars_histograms_and_resume_purge(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    torch = pytest.importorskip("torch")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    weights = [("layer.weight", torch.arange(12.0).reshape(3, 4)), ("empty", torch.empty(0))]
    console, _ = plain_console()
    options: dict[str, Any] = {"total_steps": 6, "log_every": 1, "tensorboard": True, "histogram_every": 3,
                               "flops_per_token": 1e6, "peak_flops": 1e10, "console": console}
    with Monitor(tmp_path, **options) as first:
        for step in range(1, 7):
            run_steps(first, range(step, step + 1))
            first.histograms(step, weights)
        first.eval(6, 9.0)
    with Monitor(tmp_path, start_step=4, **options) as again:  # crashed after 6, checkpoint at 4
        for step in range(5, 7):
            run_steps(again, range(step, step + 1), loss_offset=100.0)
            again.histograms(step, weights)
        again.eval(6, 1.0)

    events = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"scalars": 0, "histograms": 0})
    events.Reload()
    tags = events.Tags()
    assert set(tags["scalars"]) == {"train/loss", "train/lr", "train/grad_norm", "perf/tokens_per_s", "perf/mfu",
                                    "perf/step_time_s", "perf/memory_bytes", "eval/loss"}
    loss = [(e.step, e.value) for e in events.Scalars("train/loss")]
    assert loss == [(1, 9.0), (2, 8.0), (3, 7.0), (4, 6.0), (5, 105.0), (6, 104.0)]  # 5 and 6 from the rerun
    assert [(e.step, e.value) for e in events.Scalars("eval/loss")] == [(6, 1.0)]
    assert [e.step for e in events.Scalars("perf/mfu")] == [1, 2, 3, 4, 5, 6]
    assert events.Scalars("perf/mfu")[0].value == pytest.approx(2000 * 1e6 / 1e10)  # step 1: 1000 tok in 0.5 s
    assert events.Scalars("perf/memory_bytes")[0].value == 3 * 2**30
    assert tags["histograms"] == ["weights/layer.weight"]
    histogram = events.Histograms("weights/layer.weight")
    assert [h.step for h in histogram] == [3, 6]
    assert (histogram[0].histogram_value.min, histogram[0].histogram_value.max) == (0.0, 11.0)
    assert histogram[0].histogram_value.num == 12


def test_tensorboard_opens_its_events_file_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """tensorboard's file layer opens the events file again for each record it appends (an open per scalar, each
    a metadata operation on a shared file system): the monitor's writer appends to one open file instead, and
    every record is there after close (docs/performance.md, run-folder operations)."""
    pytest.importorskip("tensorboard")
    pytest.importorskip("torch")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.compat.tensorflow_stub.io import gfile

    reopened: list[str] = []
    for name in ("append", "write"):
        original = getattr(gfile.LocalFileSystem, name)
        monkeypatch.setattr(gfile.LocalFileSystem, name, lambda self, filename, *rest, _original=original:
                            (reopened.append(filename), _original(self, filename, *rest))[1])
    with Monitor(tmp_path, total_steps=40, log_every=1, tensorboard=True, console=plain_console()[0]) as monitor:
        reopened.clear()  # the file's creation: its header and the purge events
        run_steps(monitor, range(1, 41))
        monitor.eval(40, 1.5)
    assert reopened == []
    events = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    assert [e.step for e in events.Scalars("train/loss")] == list(range(1, 41))
    assert [(e.step, e.value) for e in events.Scalars("eval/loss")] == [(40, 1.5)]


def test_ctx_log_records_are_kept_until_the_log_interval_and_hold_the_values_of_their_call(tmp_path: Path) -> None:
    import torch

    monitor = Monitor(tmp_path, total_steps=0, log_every=4, tensorboard=False, console=Console(file=io.StringIO()))
    loss = torch.tensor(2.0)
    for step in range(1, 4):
        monitor.scalars(step, {"loss": loss})
        loss += 1  # an in-place update after the call: the record keeps the value it was given
    path = tmp_path / METRICS_FILE
    assert path.read_text() == ""  # kept: nothing written on the step yet
    monitor.scalars(4, {"loss": loss, "accuracy": 0.5})
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(r["step"], r["loss"]) for r in records] == [(1, 2.0), (2, 3.0), (3, 4.0), (4, 5.0)]
    assert "step_time_s" in records[1] and records[3]["accuracy"] == 0.5
    monitor.scalars(5, {"loss": float("nan")})
    monitor.close()  # the rest is written at close
    assert json.loads(path.read_text().splitlines()[-1])["loss"] is None
    with pytest.raises(TypeError, match=r"ctx.log\(loss='low'\): a logged value is a number"):
        Monitor(tmp_path / "b", 0, tensorboard=False).scalars(1, {"loss": "low"})  # type: ignore[dict-item]


def test_records_kept_by_ctx_log_are_written_when_a_stop_leaves_the_process_at_once(tmp_path: Path) -> None:
    import subprocess

    code = ("import io, sys\nfrom pathlib import Path\nfrom rich.console import Console\n"
            "from hpc_train.run.quick_exit import leave_now\nfrom hpc_train.rank.runtime.monitor import Monitor\n"
            "m = Monitor(Path(sys.argv[1]), 0, log_every=100, tensorboard=False, console=Console(file=io.StringIO()))\n"
            "for step in range(1, 8):\n    m.scalars(step, {'loss': 1.0 / step})\nleave_now(144)\n")
    result = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=60,
                            check=False)
    assert result.returncode == 144, result.stderr
    steps = [json.loads(line)["step"] for line in (tmp_path / METRICS_FILE).read_text().splitlines()]
    assert steps == list(range(1, 8))


@pytest.mark.parametrize("record", [
    {"step": 3, "loss": 2.5, "step_time_s": 0.0123456789, "time": 1764700000.123456},
    {"step": 1, "loss": None, "lr": 3e-05, "big": 1.5e300, "small": -2.2250738585072014e-308, "time": 1.0},
    {"step": 7, "acc_ms": 0.1, "n": 3, "time": 2.0},
    {"step": 2, "lösung": 1.0, "time": 3.0},  # a non-ASCII name: json.dumps escapes it, and is used
    {"step": 2, "flag": True, "time": 3.0},  # not a ctx.log value: json.dumps says what it is
])
def test_a_record_line_is_exactly_what_json_dumps_writes(record: dict[str, object]) -> None:
    from hpc_train.rank.runtime.metric_lines import record_line as _record_line

    assert _record_line(record) == json.dumps(record, allow_nan=False) + "\n"
