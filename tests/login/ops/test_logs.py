"""The merged view of all rank logs: time order across ranks, continuation lines, errors first."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hpc_train.errors import ConfigError
from hpc_train.login.main import main
from hpc_train.login.ops.logs import format_text, merged_view, read_records
from tests.conftest import call_cli
from tests.failures.fixtures import GLOO_CLOSED, Rank, comm_traceback, stamp, user_traceback, write_batch, write_rank

RAISED = "RuntimeError('injected fault on rank 1 (HPC_TRAIN_INJECT_FAULT=raise:1)')"


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    """Job 571 as it ended on the local cluster: rank 1 raised, rank 0 lost its peer a second later."""
    run = tmp_path / "runs" / "raise"
    write_rank(run, "571", Rank(0, 0, [(4.0, "INFO", "step=20/300 loss=4.0331"), (4.5, "INFO", "step=25/300")],
                                error=GLOO_CLOSED, traceback=comm_traceback("RuntimeError: Connection closed by peer "
                                                                            "[127.0.0.1]:54679"), error_at=6.6),
               start_at=0.1)
    write_rank(run, "571", Rank(1, 1, [(4.2, "INFO", "straggler at step 20: rank 1 on n2 takes 90 ms")],
                                error=RAISED, traceback=user_traceback(), error_at=5.5))
    write_rank(run, "571", Rank(2, 1, error=GLOO_CLOSED, traceback=comm_traceback(
        "RuntimeError: Connection closed by peer [127.0.0.1]:17842"), error_at=6.7), world=4)
    logs = run / "logs"
    (logs / "slurm-571.out").write_text(f"hpc_train: job 571 restart 0 on n[1-2], rendezvous n1:29500\n"
                                        f"{stamp(4.0)} rank0 INFO step=20/300 loss=4.0331\n")
    (logs / "slurm-571.err").write_text("slurmstepd-n1: error: *** STEP 571.0 ON n1 CANCELLED AT "
                                        "2026-11-30T03:15:36 ***\nsrun: error: n2: task 1: Exited with exit code 1\n")
    (logs / "fabric-vm.json").write_text("{}")
    return run


def test_records_are_merged_by_time_with_their_continuation_lines(run_dir: Path) -> None:
    view = merged_view(run_dir)
    times = [r.time for r in view.timeline]
    assert times == sorted(times)
    sources = [r.source for r in view.timeline]
    assert sources[:3] == ["rank1", "rank2", "rank0"]  # start lines: ranks 1 and 2 at T0, rank 0 0.1 s later
    first_error = next(r for r in view.timeline if r.level == "ERROR")
    assert first_error.source == "rank1" and first_error.more[0] == "Traceback (most recent call last):"
    assert first_error.more[-2].startswith("RuntimeError: injected fault")  # the traceback stays with its record
    # the copy of rank 0's line in the batch output is dropped; Slurm's own lines are kept and timed
    assert sum("step=20/300" in r.text for r in view.timeline) == 1
    slurm = [r for r in view.timeline if r.source == "slurm-571.err"]
    assert len(slurm) == 2 and all(r.time is not None for r in slurm)
    assert "fabric-vm.json" not in view.sources


def test_errors_come_first_earliest_first_and_folded(run_dir: Path) -> None:
    view = merged_view(run_dir)
    assert [e.rank for e in view.errors] == [1, 0]  # rank 1 failed first; rank 2's error is rank 0's
    assert view.errors[1].same_ranks == (2,)
    assert view.errors[0].where == "distributed/faults.py:52 in maybe_inject_fault"
    text = format_text(view)
    header, _, timeline = text.partition("== timeline:")
    assert header.index("rank 1 on vm") < header.index("rank 0 on vm")
    assert "(first): " + RAISED in header and "the same error on rank 2" in header
    assert "(the same in rank2)" in header  # rank 2's traceback record, folded into rank 0's
    assert "straggler at step 20" in header  # notices count as warnings
    assert "srun: error: n2: task 1" in header
    lines = timeline.splitlines()
    assert lines[1].startswith(f"{'rank1':>13} | {stamp(0.0)} INFO start: srun rank 1/2")  # aligned prefixes
    assert f"{'':>13} | " not in timeline  # every timeline line names its source
    assert any(line.endswith("rank1 | Traceback (most recent call last):") for line in lines)


def test_one_rank_errors_only_and_tail(run_dir: Path) -> None:
    only = merged_view(run_dir, rank=1)
    assert {r.source for r in only.timeline} == {"rank1"} and [e.rank for e in only.errors] == [1]
    errors = merged_view(run_dir, errors_only=True)
    assert errors.timeline == [] and errors.errors and "== timeline" not in format_text(errors)
    tail = merged_view(run_dir, tail=3)
    assert tail.timeline == merged_view(run_dir).timeline[-3:]
    assert merged_view(run_dir, tail=0).timeline == []


def test_json_output(run_dir: Path, tmp_path: Path) -> None:
    result = call_cli(main, ["logs", str(run_dir), "--json", "--tail", "5"], tmp_path)
    assert result.code == 0, result.err
    data = json.loads(result.out)
    assert data["errors"][0]["rank"] == 1 and len(data["timeline"]) == 5
    assert data["error_records"][0]["severity"] in ("error", "warning")
    assert {"time", "source", "rank", "level", "text"} <= set(data["timeline"][0])


def test_cli_text_and_bad_input(run_dir: Path, tmp_path: Path) -> None:
    result = call_cli(main, ["logs", str(run_dir), "--errors-only"], tmp_path)
    assert result.code == 0 and result.out.startswith(f"== errors in {run_dir} ==")
    for args, where in ((["logs", str(tmp_path / "nope")], "RUN_DIR"), (["logs", str(tmp_path)], "RUN_DIR"),
                        (["logs", str(run_dir), "--rank", "9"], "--rank"),
                        (["logs", str(run_dir), "--tail", "-1"], "--tail")):
        bad = call_cli(main, args, tmp_path)
        assert bad.code == 2 and bad.err.startswith(f"error: {where}: "), (args, bad.err)
        assert "Fix: " in bad.err


def test_submitit_batch_output_joins_without_rank_copies(tmp_path: Path) -> None:
    run = tmp_path / "run"
    write_rank(run, "570", Rank(0, 0, [(17.3, "INFO", "hang: no progress for 11 s in step after step 29")]))
    write_batch(run, "570", "[rank0]: Traceback (most recent call last):\n[rank0]: RuntimeError: x\n"
                            "slurmstepd-n1: error: *** JOB 570 ON n1 CANCELLED AT 2026-11-30T03:15:20 DUE TO JOB "
                            "REQUEUE ***\nsrun: error: n1: task 0: Exited with exit code 77\n")
    view = merged_view(run)
    batch = [r for r in view.timeline if r.source == "submitit/570_0.err"]
    assert [r.text[:12] for r in batch] == ["slurmstepd-n", "srun: error:"]
    assert any(r.source == "rank0" and "hang:" in r.text for r, _ in view.error_records)


def test_lines_before_the_first_timestamp_and_files_without_any(tmp_path: Path) -> None:
    path = tmp_path / "rank-0.log"
    path.write_text("a stray line\n2026-11-30 03:15:31,000 rank0 INFO start\n  continued\n")
    records = read_records(path, "rank0", 0)
    assert [(r.text, r.more) for r in records] == [("a stray line", ()), ("start", ("  continued",))]
    other = tmp_path / "slurm-1.err"
    other.write_text("no time here\n  indented belongs above\nnor here\n")
    records = read_records(other, "slurm-1.err", None)
    assert [r.more for r in records] == [("  indented belongs above",), ()] and records[0].time is None


def test_a_missing_logs_folder_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no logs/ folder"):
        merged_view(tmp_path)


# -- issue 39: links below the run folder, numbers out of range ------------------------------------------------


def test_a_logs_folder_that_is_a_link_is_refused_and_its_files_never_shown(run_dir: Path, tmp_path: Path) -> None:
    other = tmp_path / "other"
    (run_dir / "logs").rename(other)
    (other / "rank-0.log").write_text(f"{stamp(1)} rank0 ERROR SECRET of another place\n")
    (run_dir / "logs").symlink_to(other)
    result = call_cli(main, ["logs", str(run_dir)], tmp_path)
    assert result.code == 2 and "symbolic link" in result.err and "SECRET" not in result.out + result.err


def test_a_linked_rank_log_or_error_record_is_not_read(run_dir: Path, tmp_path: Path) -> None:
    (tmp_path / "secret.log").write_text(f"{stamp(1)} rank0 ERROR SECRET\n")
    (tmp_path / "secret.json").write_text(json.dumps({"rank": 0, "error": "SECRET", "time": 1.0}))
    for name, target in (("ranks-0-0.log", "secret.log"), ("rank-0.error.json", "secret.json")):
        (run_dir / "logs" / name).unlink()
        (run_dir / "logs" / name).symlink_to(tmp_path / target)
    text = format_text(merged_view(run_dir))
    assert "SECRET" not in text and "ranks-0-0.log: not read" in text


@pytest.mark.parametrize("when", ["1e308", "1" + "0" * 400, "NaN", '"noon"', "-1e308"])
def test_an_error_record_time_out_of_range_is_no_time_or_a_skipped_record(run_dir: Path, when: str) -> None:
    path = run_dir / "logs" / "rank-1.error.json"
    path.write_text(path.read_text().replace(f'"time": {json.loads(path.read_text())["time"]}', f'"time": {when}'))
    text = format_text(merged_view(run_dir))  # no OverflowError from float() or datetime.fromtimestamp
    assert "== errors in" in text
    assert all(error.time is None or error.time < 1e11 for error in merged_view(run_dir).errors)


def test_a_5000_digit_rank_in_a_log_line_is_text_not_a_record(run_dir: Path) -> None:
    with open(run_dir / "logs" / "ranks-0-0.log", "a") as out:
        out.write(f"{stamp(9)} rank{'9' * 5000} ERROR boom\n")
    view = merged_view(run_dir)
    assert not any(r.rank is not None and r.rank > 10 for r in view.timeline)
    assert any("boom" in line for r in view.timeline for line in r.more)


# -- issue 38: one log per node, each line naming its rank ---------------------------------------------------


@pytest.fixture
def node_run(tmp_path: Path) -> Path:
    """Two nodes of two ranks: ranks 0-1 in ``ranks-0-1.log``, ranks 2-3 in ``ranks-2-3.log``, their records
    interleaved in time as the ranks of a node write them; rank 3 raised."""
    run = tmp_path / "runs" / "nodes"
    for rank in range(4):
        lines = [(1.0 + rank / 10, "INFO", f"step=10/300 from rank {rank}")]
        failed = {"error": RAISED, "traceback": user_traceback(), "error_at": 5.0} if rank == 3 else {}
        write_rank(run, "580", Rank(rank, rank // 2, lines, **failed), world=4, nodes=2, start_at=rank / 100)
    return run


def test_a_node_log_gives_each_record_its_own_rank(node_run: Path) -> None:
    names = sorted(p.name for p in (node_run / "logs").iterdir() if p.name.endswith(".log"))
    assert names == ["ranks-0-1.log", "ranks-2-3.log"]
    view = merged_view(node_run)
    assert {(r.source, r.rank) for r in view.timeline} == {(f"rank{n}", n) for n in range(4)}
    assert all(f"from rank {r.rank}" in r.text for r in view.timeline if r.text.startswith("step=10"))
    failed = next(r for r in view.timeline if r.level == "ERROR")
    assert failed.rank == 3 and failed.more[0] == "Traceback (most recent call last):"  # the traceback is rank 3's
    assert [e.rank for e in view.errors] == [3]


def test_one_rank_of_a_node_log_and_a_rank_that_is_not_there(node_run: Path, tmp_path: Path) -> None:
    only = merged_view(node_run, rank=2)
    assert {r.rank for r in only.timeline} == {2} and len(only.timeline) == 2
    assert only.sources == ["ranks-2-3.log"]
    with pytest.raises(ConfigError, match=r"pick one of: 0-3"):
        merged_view(node_run, rank=7)


def test_an_older_one_rank_log_beside_node_logs_is_still_read(node_run: Path) -> None:
    write_rank(node_run, "579", Rank(1, 0, [(0.5, "INFO", "an older version's line")]), world=4, nodes=2,
               one_rank_log=True)
    ranks_1 = merged_view(node_run, rank=1)
    assert any("an older version's line" in r.text for r in ranks_1.timeline)
    assert {r.rank for r in ranks_1.timeline} == {1} and ranks_1.sources == ["ranks-0-1.log", "rank-1.log"]


def test_a_log_name_claiming_a_billion_ranks_is_not_a_node_s_log(node_run: Path) -> None:
    """A planted (or damaged) ``ranks-0-999999999.log`` is no node's log: no reader walks its range."""
    from hpc_train.failures.evidence import collect_evidence

    (node_run / "logs" / "ranks-0-999999999.log").write_text(f"{stamp(1)} rank5 ERROR planted\n")
    with pytest.raises(ConfigError, match=r"pick one of: 0-3"):
        merged_view(node_run, rank=9)
    assert not any("planted" in r.text for r in merged_view(node_run).timeline)
    assert sorted(report.rank for report in collect_evidence(node_run, "580").ranks) == [0, 1, 2, 3]
