"""The status view from fixture run folders and a fake scheduler: one squeue and one sacct call per poll for every
run shown, the run folder's telemetry, a just-submitted job, a failed attempt's class, no Slurm at all."""

from __future__ import annotations

import functools
import io
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console

from hpc_train.backends import scheduler
from hpc_train.login.main import main
from hpc_train.login.ops.status import collect, find_run_dirs, render, sparkline, to_json
from tests.conftest import REPO, call_cli
from tests.failures.fixtures import (
    T0,
    Rank,
    sacct_line,
    squeue_line,
    user_traceback,
    write_attempts,
    write_batch,
    write_checkpoint,
    write_metrics,
    write_plan,
    write_rank,
)


class FakeSlurm:
    """Answers squeue and sacct like Slurm 22.05 and counts the calls."""

    def __init__(self, squeue: list[str], sacct: list[str]) -> None:
        self.squeue, self.sacct = squeue, sacct
        self.calls: list[list[str]] = []

    def __call__(self, argv: list[str]) -> subprocess.CompletedProcess[str]:
        self.calls.append(argv)
        text = "\n".join(self.squeue if argv[0] == "squeue" else self.sacct) + "\n"
        return subprocess.CompletedProcess(argv, 0, text, "")

    def poll(self, job_ids: list[str], run_dirs: list[Path]) -> scheduler.SchedulerAnswer:
        return scheduler.poll(job_ids, run_dirs, run=self, which=lambda name: f"/usr/bin/{name}")


@pytest.fixture
def runs(tmp_path: Path) -> dict[str, Path]:
    """A running run, a failed one, one just submitted through submitit, one rendered and still pending."""
    root = tmp_path / "runs"
    running = root / "train"
    write_plan(running, "train", steps=300)
    write_attempts(running, [{"job_id": "565", "started": T0, "start_step": 0}])
    write_metrics(running, range(5, 155, 5), start=T0, seconds_per_step=0.5)
    write_checkpoint(running, 100)
    failed = root / "raise"
    write_plan(failed, "raise")
    write_attempts(failed, [{"job_id": "571", "started": T0, "outcome": "failed", "ended": T0 + 6, "end_step": 25}])
    write_rank(failed, "571", Rank(1, 1, error="ValueError('bad')", traceback=user_traceback(
        "ValueError: bad", ("/work/project/train/data.py", 123, "batches"))))
    write_batch(failed, "571", "srun: error: n2: task 1: Exited with exit code 1\n")
    submitted = root / "fresh"
    write_plan(submitted, "fresh")
    (submitted / "submitit").mkdir()
    (submitted / "submitit" / "600_submitted.pkl").write_bytes(b"")
    rendered = root / "rendered"
    write_plan(rendered, "rendered")
    return {"running": running, "failed": failed, "submitted": submitted, "rendered": rendered}


def _slurm(runs: dict[str, Path]) -> FakeSlurm:
    rendered = str(runs["rendered"].resolve())
    return FakeSlurm(
        squeue=[squeue_line("565", "RUNNING", "n[1-2]"), squeue_line("600", "PENDING", reason="Priority"),
                squeue_line("601", "PENDING", reason="Resources", stdout=f"{rendered}/logs/slurm-%j.out",
                            workdir=rendered),
                squeue_line("999", "RUNNING", "n3", workdir="/somewhere/else")],
        sacct=[sacct_line("565", "RUNNING", elapsed="00:01:15"), "565.batch|565.batch|RUNNING|0:0|n1||x|x|x|",
               sacct_line("571", "FAILED", "1:0"), "571.0|571.0|FAILED|1:0|n[1-2]||x|x|x|",
               sacct_line("600", "PENDING", nodes="None assigned", reason="Priority")])


def test_one_squeue_and_one_sacct_call_for_all_runs(runs: dict[str, Path]) -> None:
    slurm = _slurm(runs)
    statuses, answer = collect(list(runs.values()), poll=slurm.poll)
    assert [argv[0] for argv in slurm.calls] == ["squeue", "sacct"] and answer.calls == 2
    squeue, sacct = slurm.calls
    assert squeue[:3] == ["squeue", "--me", "--noheader"]
    jobs = sacct[sacct.index("--jobs") + 1].split(",")
    assert jobs == ["565", "571", "600", "601"]  # the folders' ids and the queued job found by its output path
    assert "--duplicates" in sacct and "999" not in jobs
    assert len(statuses) == 4


def test_a_running_run_joins_the_queue_with_its_telemetry(runs: dict[str, Path]) -> None:
    statuses, _ = collect([runs["running"]], poll=_slurm(runs).poll)
    (run,) = statuses
    assert (run.state, run.job_id, run.nodes) == ("RUNNING", "565", "n[1-2]")
    t = run.telemetry
    assert (t.step, t.total_steps, t.tokens_per_s, t.mfu) == (150, 300, 18000.0, 0.42)
    assert t.loss == pytest.approx(5.0 - 1.5)
    assert t.seconds_per_step == pytest.approx(0.5)  # from the records' times, not the mean step time alone
    assert t.eta_s == pytest.approx(150 * 0.5)
    assert run.checkpoint is not None and run.checkpoint.step == 100
    assert [(a.job_id, a.outcome) for a in run.attempts] == [("565", "running")] and run.failure is None


def test_a_just_submitted_job_is_pending_before_anything_ran(runs: dict[str, Path]) -> None:
    statuses, _ = collect([runs["submitted"], runs["rendered"]], poll=_slurm(runs).poll)
    fresh, rendered = statuses
    assert (fresh.state, fresh.job_id, fresh.reason, fresh.nodes) == ("PENDING", "600", "Priority", "pending")
    assert (rendered.state, rendered.job_id, rendered.reason) == ("PENDING", "601", "Resources")
    assert fresh.telemetry.step is None and fresh.attempts == []


def test_a_pending_job_known_only_to_accounting_is_pending_not_none_assigned(runs: dict[str, Path]) -> None:
    slurm = _slurm(runs)
    slurm.squeue = [line for line in slurm.squeue if not line.startswith("600")]
    (fresh,) = collect([runs["submitted"]], poll=slurm.poll)[0]
    assert (fresh.state, fresh.nodes) == ("PENDING", "pending")
    slurm.sacct = [sacct_line("600", "CANCELLED", nodes="None assigned")]
    (fresh,) = collect([runs["submitted"]], poll=slurm.poll)[0]
    assert (fresh.state, fresh.nodes) == ("CANCELLED", "")  # ended before it had nodes: the table shows -


def test_a_failed_run_shows_its_failure_class(runs: dict[str, Path]) -> None:
    statuses, _ = collect([runs["failed"]], poll=_slurm(runs).poll)
    (run,) = statuses
    assert run.state == "FAILED" and run.failure is not None
    assert run.failure.failure_class == "user_error"
    assert run.failure.reason == "user error: ValueError('bad') raised on rank 1 (n2) in train/data.py:123"
    assert run.attempts[0].failure is not None and run.attempts[0].failure["class"] == "user_error"


def test_json_has_every_detail(runs: dict[str, Path]) -> None:
    statuses, answer = collect(list(runs.values()), poll=_slurm(runs).poll)
    data = json.loads(to_json(statuses, answer, now=T0 + 100))
    assert data["slurm"] == {"available": True, "notes": [], "calls": 2}
    by_name = {run["name"]: run for run in data["runs"]}
    assert by_name["train"]["telemetry"]["eta_s"] == pytest.approx(75.0)
    assert by_name["raise"]["failure"]["class"] == "user_error"
    assert by_name["fresh"]["job_ids"] == ["600"]


def test_the_rendered_view_has_a_row_per_run_and_the_failure_line(runs: dict[str, Path]) -> None:
    statuses, answer = collect(list(runs.values()), poll=_slurm(runs).poll)
    console = Console(file=io.StringIO(), width=200, color_system=None)
    console.print(render(statuses, answer, now=T0 + 100))
    text = console.file.getvalue()
    for name, state in (("train", "RUNNING"), ("raise", "FAILED"), ("fresh", "PENDING (Priority)"),
                        ("rendered", "PENDING (Resources)")):
        line = next(line for line in text.splitlines() if line.strip().startswith(name))
        assert state in line, line
    assert "150/300" in text and "18,000" in text and "42.0%" in text and "0:01:15" in text
    assert "raise: user_error  user error: ValueError('bad')" in text
    one = Console(file=io.StringIO(), width=200, color_system=None)
    one.print(render(statuses[:1], answer, now=T0 + 100))
    assert "attempts" in one.file.getvalue() and "run folder" in one.file.getvalue()


def test_without_slurm_the_run_folders_speak_alone(runs: dict[str, Path]) -> None:
    answer_calls: list[list[str]] = []

    def poll(job_ids: list[str], run_dirs: list[Path]) -> scheduler.SchedulerAnswer:
        return scheduler.poll(job_ids, run_dirs, run=answer_calls.append, which=lambda name: None)

    statuses, answer = collect(list(runs.values()), poll=poll)
    assert answer_calls == [] and not answer.available and "not available" in answer.notes[0]
    by_name = {s.name: s for s in statuses}
    assert by_name["train"].state == "RUNNING" and by_name["train"].telemetry.step == 150
    assert by_name["raise"].state == "FAILED" and by_name["raise"].failure.failure_class == "user_error"
    assert by_name["fresh"].state == "UNKNOWN"


def test_a_scheduler_that_fails_is_a_note_not_a_crash(runs: dict[str, Path]) -> None:
    def broken(argv: list[str]) -> subprocess.CompletedProcess[str]:
        return subprocess.CompletedProcess(argv, 1, "", "slurm_load_jobs error: Unable to contact slurm controller")

    poll = functools.partial(scheduler.poll, run=broken, which=lambda name: name)
    statuses, answer = collect([runs["running"]], poll=poll)
    assert answer.calls == 2 and any("Unable to contact" in note for note in answer.notes)
    assert statuses[0].state == "RUNNING"  # from attempts.jsonl


def test_local_runs_ask_no_scheduler(tmp_path: Path) -> None:
    run = tmp_path / "runs" / "local"
    write_plan(run, "local", executor="local", steps=30)
    write_attempts(run, [{"job_id": "3001", "host": "elsewhere", "started": T0, "outcome": "completed",
                          "end_step": 30}])
    statuses, answer = collect([run], poll=lambda *a: pytest.fail("polled"))
    assert statuses[0].state == "COMPLETED" and answer.calls == 0 and statuses[0].job_ids == []


def test_parsers() -> None:
    assert scheduler.parse_duration("1-02:03:04") == 93784
    assert scheduler.parse_duration("03:04") == 184 and scheduler.parse_duration("30") == 1800
    assert scheduler.parse_duration("UNLIMITED") is None and scheduler.parse_duration("INVALID") is None
    history = scheduler.parse_sacct("\n".join([
        sacct_line("370", "REQUEUED"), "370.batch|370.batch|CANCELLED|0:15|n1||x|x|x|",
        "370.0|370.0|FAILED|75:0|n[1-2]||x|x|x|", sacct_line("370", "COMPLETED", reason="BeginTime"),
        "370.0|370.0|COMPLETED|0:0|n[1-2]||x|x|x|", sacct_line("531_0", "RUNNING", raw="532"),
        "531_0.batch|532.batch|RUNNING|0:0|n1||x|x|x|", "garbage"]))
    first, second = history["370"]
    assert first.base_state == "REQUEUED" and [s.exit_code for s in first.steps] == ["0:15", "75:0"]
    assert first.exit_statuses() == [(0, 15), (75, 0), (0, 0)]
    assert second.reason == "BeginTime" and len(second.steps) == 1
    assert history["532"] is history["531_0"] and history["532"][0].steps[0].step == "batch"
    entries = scheduler.parse_squeue(squeue_line("532", "RUNNING", "n1", array="531_0") + "\nshort|line")
    assert len(entries) == 1 and entries[0].ids() == {"532", "531_0"} and entries[0].reason == ""


def test_cli_json_and_bad_input(runs: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(scheduler.shutil, "which", lambda name: None)  # the unit tests never ask a real cluster
    result = call_cli(main, ["status", str(runs["running"]), str(runs["failed"]), "--json"], tmp_path)
    assert result.code == 0, result.err
    data = json.loads(result.out)
    assert [run["name"] for run in data["runs"]] == ["train", "raise"] and data["slurm"]["calls"] == 0
    default = call_cli(main, ["status", "--json"], runs["running"].parent.parent)  # every ./runs/* folder
    assert len(json.loads(default.out)["runs"]) == 4
    for args, where in ((["status", str(tmp_path / "nope")], "RUN_DIR"), (["status", str(tmp_path)], "RUN_DIR"),
                        (["status", str(runs["running"]), "--watch", "0"], "--watch")):
        bad = call_cli(main, args, tmp_path)
        assert bad.code == 2 and bad.err.startswith(f"error: {where}: ") and "Fix: " in bad.err, bad.err
    (tmp_path / "empty").mkdir()
    empty = call_cli(main, ["status"], tmp_path / "empty")
    assert empty.code == 2 and "./runs holds no run folder" in empty.err


def test_find_run_dirs_lists_each_folder_once(runs: dict[str, Path]) -> None:
    same = runs["running"]
    assert find_run_dirs([same, same.parent / "." / same.name]) == [same]


@pytest.mark.parametrize("command", ["status", "logs"])
def test_the_commands_never_import_torch(runs: dict[str, Path], command: str) -> None:
    """Login-node commands: a subprocess runs the real CLI and checks sys.modules at the end."""
    args = [command, str(runs["failed"]), "--json"]
    code = ("import runpy, sys\n"
            f"sys.argv = ['hpc_train', *{args!r}]\n"
            "try:\n    runpy.run_module('hpc_train', run_name='__main__', alter_sys=True)\n"
            "except SystemExit as exit:\n    assert not exit.code, exit.code\n"
            "assert 'torch' not in sys.modules, 'torch was imported'\n"
            "assert 'deepspeed' not in sys.modules, 'deepspeed was imported'\n")
    env = {**os.environ, "PATH": str(Path(sys.executable).parent)}  # no Slurm: the run folder alone
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    assert (data["runs"][0]["failure"]["class"] if command == "status" else data["errors"][0]["rank"]) in (
        "user_error", 1)


def test_watching_draws_the_recent_loss_as_a_sparkline(runs: dict[str, Path]) -> None:
    statuses, answer = collect(list(runs.values()), poll=_slurm(runs).poll)
    train = next(s for s in statuses if s.name == "train")
    assert len(train.telemetry.losses) >= 2
    console = Console(file=io.StringIO(), width=220, color_system=None)
    console.print(render(statuses, answer, now=T0 + 100, trend=True))
    line = next(line for line in console.file.getvalue().splitlines() if line.strip().startswith("train"))
    assert sparkline(train.telemetry.losses) in line and "trend" in console.file.getvalue()
    assert sparkline([3.0, 2.0, 1.0]) == "█▅▁" and sparkline([1.0]) == "" and sparkline([2.0, 2.0]) == "▁▁"


def test_a_run_s_health_is_a_column_its_findings_are_listed_and_in_json(runs: dict[str, Path]) -> None:
    finding = {"check": "data_wait", "step": 40, "figure": "55% of the step waits for data", "threshold": "30%",
               "cause": "a loader that does not keep up", "fix": "raise data.num_workers (now 0)"}
    (runs["running"] / "health.json").write_text(json.dumps({"findings": [finding], "history": []}))
    (runs["failed"] / "health.json").write_text(json.dumps({"findings": [], "history": []}))
    (runs["rendered"] / "health.json").write_text('{"findings": [')  # torn: as if there were none
    statuses, answer = collect(list(runs.values()), poll=_slurm(runs).poll)
    console = Console(file=io.StringIO(), width=240, color_system=None)
    console.print(render(statuses, answer, now=T0 + 100))
    rows = {line.split()[0]: line for line in console.file.getvalue().splitlines() if line.strip()[:1].isalpha()}
    assert rows["train"].rstrip().endswith("data_wait") and rows["raise"].rstrip().endswith("ok")
    assert rows["rendered"].rstrip().endswith("-")
    one = Console(file=io.StringIO(), width=300, color_system=None)
    one.print(render(statuses[:1], answer, now=T0 + 100))
    assert ("health: data_wait since step 40: 55% of the step waits for data (threshold 30%); likely a loader that "
            "does not keep up; fix: raise data.num_workers (now 0)") in one.file.getvalue()
    by_name = {run["name"]: run for run in json.loads(to_json(statuses, answer))["runs"]}
    assert by_name["train"]["health"] == [finding] and by_name["raise"]["health"] == []
    assert by_name["rendered"]["health"] is None


# -- issue 39: links below the run folder, numbers out of range ------------------------------------------------


def _local_run(tmp_path: Path) -> Path:
    run = tmp_path / "runs" / "gpt"
    write_plan(run, executor="local")
    write_attempts(run, [{"job_id": "1", "started": T0, "outcome": "completed", "ended": T0 + 10, "end_step": 9}])
    write_metrics(run, range(10), T0, 1.0)
    write_checkpoint(run, 8)
    return run


def _holds_step_777(value: object) -> bool:
    if isinstance(value, dict):
        return any(_holds_step_777(item) for item in value.values())
    if isinstance(value, list):
        return any(_holds_step_777(item) for item in value)
    return value == 777 or (isinstance(value, str) and "777" in value)


@pytest.mark.parametrize("planted", ["checkpoints", "checkpoints/latest", "logs"])
def test_status_never_reads_through_a_link_below_the_run_folder(tmp_path: Path, planted: str) -> None:
    run, other = _local_run(tmp_path), tmp_path / "other"
    other.mkdir()
    (other / "latest").write_text("step-777")
    (other / "rank-0.error.json").write_text(json.dumps({"rank": 0, "time": T0, "error": "SECRET"}))
    target = run / planted
    if target.is_dir():
        for child in target.iterdir():
            child.unlink() if child.is_file() else child.rmdir()
        target.rmdir()
    else:
        target.unlink()
    target.symlink_to(other / "latest" if planted.endswith("latest") else other)
    result = call_cli(main, ["status", "--json", str(run)], tmp_path)
    # the planted step as a number or a name anywhere (not as digits of a time: a clock once read ...420777)
    assert result.code == 0 and not _holds_step_777(json.loads(result.out)) and "SECRET" not in result.out
    assert json.loads(result.out)["runs"][0]["state"] == "COMPLETED"  # no "failed" from another place's record


def test_status_refuses_a_run_folder_that_is_a_link(tmp_path: Path) -> None:
    run = _local_run(tmp_path)
    (tmp_path / "alias").symlink_to(run)
    result = call_cli(main, ["status", str(tmp_path / "alias")], tmp_path)
    assert result.code == 2 and "symbolic link" in result.err


@pytest.mark.parametrize("value", ["1" + "0" * 400, "1e308", "-1e308", "NaN", "Infinity", "9" * 5000])
def test_numbers_no_float_holds_never_reach_the_view(tmp_path: Path, value: str) -> None:
    run = _local_run(tmp_path)
    with open(run / "metrics.jsonl", "a") as out:
        out.write(f'{{"step": 10, "loss": {value}, "time": {value}, "mfu": {value}, "tokens_per_s": {value}}}\n')
        out.write(f'{{"step": {value}, "loss": 1.0}}\n')
    lines = (run / "attempts.jsonl").read_text().splitlines()
    (run / "attempts.jsonl").write_text("\n".join([*lines, lines[0].replace(f'"started": {T0}', f'"started": {value}')
                                                   .replace('"attempt": 1', '"attempt": 2'),
                                                   lines[0].replace('"job_id": "1"', f'"job_id": "{"9" * 4000}"')
                                                   .replace('"outcome": "completed"', '"outcome": "running"')
                                                   .replace('"host": "vm"', f'"host": "{socket.gethostname()}"')
                                                   .replace('"attempt": 1', '"attempt": 3')]) + "\n")
    for argv in (["status", str(run)], ["status", "--json", str(run)]):
        result = call_cli(main, argv, tmp_path)
        assert result.code == 0, result.err
        assert "unexpected" not in result.err
    json.loads(result.out, parse_constant=lambda name: pytest.fail(f"{name} in --json"))


def test_a_health_check_named_like_rich_markup_is_shown_as_typed(tmp_path: Path) -> None:
    run = _local_run(tmp_path)
    (run / "health.json").write_text(json.dumps({"findings": [{"check": "[/]", "step": 1}]}))
    result = call_cli(main, ["status", str(run)], tmp_path)
    assert result.code == 0 and "[/]" in result.out, result.err
