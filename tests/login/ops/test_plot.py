"""``python -m hpc_train plot``: the figure is drawn from metrics.jsonl and attempts.jsonl (what ``--json`` prints is
what was drawn), every attempt's start and end is marked where the records put it, and a missing, empty or damaged
run folder, a metric no run logged or an output it cannot write exit 2 with one message. A run preempted twice on
the local executor, plotted: tests/rank/program/test_runner_local.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hpc_train.errors import ConfigError
from hpc_train.login.ops.plot import choose_panels
from hpc_train.login.ops.plot_data import Mark, read_run
from hpc_train.run.attempts import AttemptLog
from tests.conftest import REPO

T0 = 1_796_000_000.0


def _run_folder(tmp_path: Path, name: str = "gpt") -> Path:
    """A run of 30 steps in three attempts: preempted and requeued at step 12 (the next attempt resumed there),
    then a failure at 20 with no end step recorded (found from the time), then completed."""
    run_dir = tmp_path / name
    run_dir.mkdir()
    lines = [{"step": s, "time": T0 + s, "loss": 5.0 - s / 10, "lr": 1e-3, "tokens_per_s": 1000.0 + s}
             for s in range(1, 31)] + [{"step": 10, "time": T0 + 10.5, "eval_loss": 4.2}]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    log = AttemptLog(run_dir)
    first = log.begin(job_id="7", restart=0, host="n1", started=T0, start_step=0)
    log.finish(first, outcome="preempted", ended=T0 + 12.5, end_step=12, signal="SIGUSR2", requeued=True)
    second = log.begin(job_id="7", restart=1, host="n1", started=T0 + 13, start_step=12)
    log.finish(second, outcome="failed", ended=T0 + 20.2, end_step=None)
    third = log.begin(job_id="8", restart=0, host="n2", started=T0 + 21, start_step=20)
    log.finish(third, outcome="completed", ended=T0 + 31, end_step=30)
    return run_dir


def test_the_marks_come_from_the_attempts_and_the_series_from_the_metrics(tmp_path: Path) -> None:
    run = read_run(_run_folder(tmp_path))
    assert run.marks == [
        Mark(12.0, 1, "preempted", "attempt 1 preempted, requeued (SIGUSR2)"),
        Mark(12.0, 2, "start", "attempt 2 from step 12"),
        Mark(20.0, 2, "failed", "attempt 2 failed"),  # no end step: the last step logged before it ended
        Mark(20.0, 3, "start", "attempt 3 from step 20")]
    assert run.series["loss"][0] == [float(s) for s in range(1, 31)]
    assert run.series["eval_loss"] == ([10.0], [4.2])
    assert choose_panels([run], None) == [("loss", "eval_loss"), ("lr",), ("tokens_per_s",)]
    assert choose_panels([run], ["lr"]) == [("lr",)]


def _plot(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "hpc_train", "plot", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=120, check=False)


def test_plot_writes_a_png_of_two_runs_and_says_what_it_drew(tmp_path: Path) -> None:
    one, two = _run_folder(tmp_path, "a"), _run_folder(tmp_path, "b")
    result = _plot(str(one), str(two), "--out", "both.png", "--json", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    drawn = json.loads(result.stdout)
    assert drawn["out"] == "both.png" and drawn["panels"] == [["loss", "eval_loss"], ["lr"], ["tokens_per_s"]]
    assert [run["run"] for run in drawn["runs"]] == ["a", "b"]
    assert [m["kind"] for m in drawn["runs"][0]["marks"]] == ["preempted", "start", "failed", "start"]
    assert drawn["runs"][0]["points"]["loss"] == 30
    assert (tmp_path / "both.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    plain = _plot(str(one), cwd=tmp_path)
    assert plain.returncode == 0 and plain.stdout.strip() == "wrote plot.png: 3 panel(s), 1 run(s), 4 attempt mark(s)"


def _folder(tmp_path: Path, kind: str) -> Path:
    run_dir = tmp_path / kind
    if kind != "missing":
        run_dir.mkdir()
    if kind == "torn":
        (run_dir / "metrics.jsonl").write_text('{"step": 1, "lo\n\x00\n[1, 2]\n')
    return run_dir


@pytest.mark.parametrize(("kind", "words"), [("missing", "is not a folder"), ("empty", "has no metrics.jsonl"),
                                             ("torn", "holds no metrics record")])
def test_a_missing_empty_or_damaged_run_folder_exits_2_with_one_message(tmp_path: Path, kind: str,
                                                                        words: str) -> None:
    run_dir = _folder(tmp_path, kind)
    result = _plot(str(run_dir), cwd=tmp_path)
    assert result.returncode == 2 and words in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "plot.png").exists()


def test_a_metric_no_run_logged_or_an_output_it_cannot_write_exits_2(tmp_path: Path) -> None:
    run_dir = _run_folder(tmp_path)
    result = _plot(str(run_dir), "--metric", "mfu", cwd=tmp_path)
    assert result.returncode == 2
    assert "--metric: mfu is in no run's metrics.jsonl" in result.stderr and "pick from: eval_loss, loss, lr" in \
        result.stderr
    for out, words in (("plot.jpg", "is not one of .png, .svg, .pdf"),
                       ("nowhere/plot.png", "the folder nowhere does not exist")):
        result = _plot(str(run_dir), "--out", out, cwd=tmp_path)
        assert result.returncode == 2 and words in result.stderr, result.stderr


def test_plot_imports_no_torch_and_matplotlib_only_when_it_draws(tmp_path: Path) -> None:
    code = ("import sys\nimport hpc_train.login.ops.plot, hpc_train.login.ops.plot_data\nprint('torch' in sys.modules, "
            "'matplotlib' in sys.modules)\nfrom hpc_train.login.main import main\n"
            f"main(['plot', {str(_run_folder(tmp_path))!r}, '--out', {str(tmp_path / 'p.png')!r}])\n"
            "print('torch' in sys.modules, 'matplotlib' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60,
                            check=True)
    assert result.stdout.strip().splitlines()[::2] == ["False False", "False True"]


def test_config_error_names_the_key() -> None:
    with pytest.raises(ConfigError, match="RUN_DIR"):
        read_run(Path("/nonexistent/run"))


# -- issue 39: a long line, numbers out of range, links ---------------------------------------------------------


def test_a_30_mb_line_is_said_and_the_records_after_it_are_drawn(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture) -> None:
    run_dir = _run_folder(tmp_path)
    text = (run_dir / "metrics.jsonl").read_text()
    (run_dir / "metrics.jsonl").write_text('{"step": 0, "loss": 6.0}\n' + "x" * (30 << 20) + "\n" + text)
    run = read_run(run_dir)
    assert run.series["loss"][0] == [0.0, *map(float, range(1, 31))]
    assert "metrics.jsonl:2: is longer than" in capsys.readouterr().err


@pytest.mark.parametrize("value", ["1" + "0" * 400, "1e308", "NaN", "Infinity", "9" * 5000])
def test_a_number_no_float_holds_is_a_skipped_record_or_no_point(tmp_path: Path, value: str,
                                                                 capsys: pytest.CaptureFixture) -> None:
    run_dir = _run_folder(tmp_path)
    with open(run_dir / "metrics.jsonl", "a") as out:
        out.write(f'{{"step": {value}, "loss": 1.0}}\n{{"step": 40, "loss": {value}, "time": {value}}}\n')
    run = read_run(run_dir)
    steps, values = run.series["loss"]
    assert all(abs(v) < 1e300 or v == 1e308 for v in values) and steps[-1] in (30.0, 40.0)
    json.dumps(run.summary(), allow_nan=False)
    assert ("metrics.jsonl:32:" in capsys.readouterr().err) == (value != "1e308")  # 1e308 is a float


def test_a_run_folder_or_metrics_file_that_is_a_link_is_refused(tmp_path: Path) -> None:
    run_dir = _run_folder(tmp_path)
    (tmp_path / "alias").symlink_to(run_dir)
    with pytest.raises(ConfigError, match="symbolic link"):
        read_run(tmp_path / "alias")
    (run_dir / "metrics.jsonl").rename(tmp_path / "elsewhere.jsonl")
    (run_dir / "metrics.jsonl").symlink_to(tmp_path / "elsewhere.jsonl")
    with pytest.raises(ConfigError, match=r"metrics\.jsonl"):
        read_run(run_dir)


def test_the_step_shares_panel_draws_comm_share_with_a_label_that_fits(tmp_path: Path) -> None:
    """The trainer's breakdown logs five shares; comm_share was not drawn, and the five names joined as the
    y-label ran past the bottom panel and were clipped (the legend, beside the panels, names each line)."""
    from hpc_train.login.ops.plot import _label

    run_dir = tmp_path / "shares"
    run_dir.mkdir()
    shares = {"data_share": 0.1, "forward_share": 0.3, "backward_share": 0.4, "optimizer_share": 0.2,
              "comm_share": 0.15}
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "time": T0 + s, "loss": 1.0, **shares})
                                                   + "\n" for s in range(1, 5)))
    panels = choose_panels([read_run(run_dir)], None)
    assert panels[-1] == ("data_share", "forward_share", "backward_share", "optimizer_share", "comm_share")
    assert _label(panels[-1]) == "share of the step" and _label(("loss", "eval_loss")) == "loss / eval_loss"
    result = _plot(str(run_dir), "--out", "shares.png", cwd=tmp_path)
    assert result.returncode == 0 and (tmp_path / "shares.png").stat().st_size > 0, result.stderr
