"""Looking back as a requeued attempt starts, with Slurm's answers scripted: node failures are excluded and put on
the job, an attempt on an excluded node requeues, the retry limit stops, and program errors are left alone."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from hpc_train.failures import recovery
from hpc_train.failures.policy import RetryPolicy
from hpc_train.failures.recovery import look_back, requeue_after_error
from hpc_train.run.attempts import AttemptLog
from hpc_train.run.exclusions import read_exclusions

FIELDS = "|".join(["{id}", "{id}", "{state}", "{code}", "{nodes}", "None", "{start}", "{end}", "00:01:00",
                   "01:00:00"])


def _sacct(*attempts: tuple[str, str, str]) -> str:
    return "".join(FIELDS.format(id="77", state=state, code="0:0", nodes=nodes, start=start, end="Unknown"
                                 if state == "RUNNING" else "2026-11-30T03:20:52") + "\n"
                   for state, nodes, start in attempts)


class FakeSlurm:
    """Answers each Slurm command from a table and records every call."""

    def __init__(self, answers: dict[str, str]) -> None:
        self.answers = answers
        self.calls: list[list[str]] = []

    def __call__(self, argv: list[str], **_: object) -> subprocess.CompletedProcess[str]:
        self.calls.append(argv)
        key = " ".join(argv[:2])
        text = next((value for prefix, value in self.answers.items() if key.startswith(prefix)), "")
        return subprocess.CompletedProcess(argv, 0, text, "")

    def called(self, *words: str) -> list[list[str]]:
        return [argv for argv in self.calls if all(word in argv for word in words)]


@pytest.fixture(autouse=True)
def _slurm_on_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(recovery.shutil, "which", lambda name: f"/usr/bin/{name}")
    monkeypatch.setattr(recovery.time, "sleep", lambda _: None)


def _run_dir(tmp_path: Path, outcome: str = "preempted") -> Path:
    (tmp_path / "logs").mkdir()
    log = AttemptLog(tmp_path)
    log.finish(log.begin("77", 0, "vm", 0.0, 0), outcome=outcome, end_step=19)
    return tmp_path


NODE_FAIL = {
    "sacct --noheader": _sacct(("NODE_FAIL", "n1", "2026-11-30T03:20:46"), ("RUNNING", "n1", "2026-11-30T03:21:06")),
    "sacctmgr --noheader": "n1|DOWN\n",
    "sinfo --noheader": "n1|idle\n",
}


def test_a_node_failure_excludes_the_node_and_moves_off_it(tmp_path: Path) -> None:
    run_dir = _run_dir(tmp_path)
    slurm = FakeSlurm(NODE_FAIL)
    logs: list[str] = []
    result = look_back(run_dir, "77", 1, RetryPolicy(), ["n1"], logs.append, run=slurm)
    assert result.action == "requeue" and result.failure_class == "node_failure"
    assert [e.node for e in read_exclusions(run_dir)] == ["n1"]
    assert slurm.called("scontrol", "requeue", "77")
    assert slurm.called("scontrol", "update", "JobId=77", "ExcNodeList=n1")
    [attempt] = AttemptLog(run_dir).read()
    assert attempt.outcome == "node_failure" and "n1" in attempt.note


def test_landing_elsewhere_continues(tmp_path: Path) -> None:
    run_dir = _run_dir(tmp_path)
    slurm = FakeSlurm(NODE_FAIL)
    result = look_back(run_dir, "77", 1, RetryPolicy(), ["n2"], lambda _: None, run=slurm)
    assert result.action == "continue" and "excluding n1" in result.message
    assert not slurm.called("scontrol", "requeue")


def test_the_retry_limit_stops_the_run(tmp_path: Path) -> None:
    run_dir = _run_dir(tmp_path, outcome="node_failure")  # an earlier node failure already counted
    log = AttemptLog(run_dir)
    log.finish(log.begin("77", 1, "vm", 0.0, 19), outcome="preempted", end_step=25)
    result = look_back(run_dir, "77", 2, RetryPolicy(max_node_failure=1), ["n2"], lambda _: None,
                       run=FakeSlurm(NODE_FAIL))
    assert result.action == "stop" and "the policy allows 1 retry" in result.message


def test_a_first_attempt_on_an_excluded_node_requeues(tmp_path: Path) -> None:
    run_dir = _run_dir(tmp_path)
    (run_dir / "excluded_nodes.json").write_text(json.dumps({"nodes": [{"node": "n2", "class": "node_failure"}]}))
    slurm = FakeSlurm({})
    assert look_back(run_dir, "80", 0, RetryPolicy(), ["n1"], lambda _: None, run=slurm).action == "continue"
    assert look_back(run_dir, "80", 0, RetryPolicy(), ["n2"], lambda _: None, run=slurm).action == "requeue"


def test_a_program_error_is_not_retried(tmp_path: Path) -> None:
    run_dir = _run_dir(tmp_path)
    slurm = FakeSlurm({})
    text = 'Traceback (most recent call last):\n  File "/x/train.py", line 3, in f\nValueError: bad batch\n'
    result = requeue_after_error(run_dir, "77", 0, 1, "n2", "ValueError('bad batch')", text, RetryPolicy(),
                                 lambda _: None, run=slurm)
    assert result.action == "continue" and result.failure_class == "user_error"
    assert slurm.calls == [] and read_exclusions(run_dir) == []


NCCL_SYSTEM_ERROR = ("Traceback (most recent call last):\n  File \"/x/torch/distributed/c10d.py\", line 3, in f\n"
                     "torch.distributed.DistBackendError: NCCL error in: ProcessGroupNCCL.cpp:1970, unhandled system "
                     "error (run with NCCL_DEBUG=INFO for details), NCCL version 2.21.5\n")
ECC_ERROR = ("Traceback (most recent call last):\n  File \"/x/model.py\", line 3, in forward\n"
             "RuntimeError: CUDA error: uncorrectable ECC error encountered\n")


def test_a_gpu_fault_excludes_its_node_and_requeues(tmp_path: Path) -> None:
    run_dir = _run_dir(tmp_path)
    slurm = FakeSlurm({})
    result = requeue_after_error(run_dir, "77", 0, 3, "gpu017", "RuntimeError('CUDA error')", ECC_ERROR,
                                 RetryPolicy(), lambda _: None, run=slurm)
    assert result.failure_class == "infrastructure" and result.action == "requeue", result
    assert [e.node for e in read_exclusions(run_dir)] == ["gpu017"]
    assert slurm.called("scontrol", "requeue", "77") and slurm.called("ExcNodeList=gpu017")


def test_a_network_error_requeues_once_per_attempt_without_excluding(tmp_path: Path) -> None:
    """Every rank of a broken link reports the NCCL error; the first decides, nobody's node is excluded."""
    run_dir = _run_dir(tmp_path)
    slurm = FakeSlurm({})
    results = [requeue_after_error(run_dir, "77", 0, rank, f"gpu0{rank}", "DistBackendError('NCCL error')",
                                   NCCL_SYSTEM_ERROR, RetryPolicy(), lambda _: None, run=slurm) for rank in range(4)]
    assert [r.action for r in results] == ["requeue", "continue", "continue", "continue"]
    assert read_exclusions(run_dir) == [] and len(slurm.called("scontrol", "requeue")) == 1


class FakeChainSlurm(FakeSlurm):
    """A site that forbids requeue: ``scontrol write batch_script`` gives the job's script, sbatch jobs 91, 92..."""

    def __call__(self, argv: list[str], **_: object) -> subprocess.CompletedProcess[str]:
        self.calls.append(argv)
        name = Path(argv[0]).name
        if name == "scontrol" and argv[1:3] == ["write", "batch_script"]:
            return subprocess.CompletedProcess(argv, 0, "#!/bin/bash\nsrun true\n", "")
        if name == "sbatch":
            submitted = sum(1 for call in self.calls if Path(call[0]).name == "sbatch")
            return subprocess.CompletedProcess(argv, 0, f"{90 + submitted}\n", "")
        return subprocess.CompletedProcess(argv, 1, "", "Requeue of job is disabled")


def test_where_requeue_is_forbidden_the_look_back_goes_on_as_the_next_job(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """``[slurm] requeue = "dependency"``: a network fault's retry and an attempt on an excluded node submit the
    job's own script again after this one (the excluded nodes as ``--exclude``), never ``scontrol requeue``, and
    the link goes into the chain, which status and the follower read."""
    from hpc_train.run.chain import REQUEUE_ENV, successor_of

    monkeypatch.setenv(REQUEUE_ENV, "dependency")
    monkeypatch.delenv("SLURM_ARRAY_TASK_ID", raising=False)
    run_dir = _run_dir(tmp_path)
    slurm = FakeChainSlurm({})
    result = requeue_after_error(run_dir, "77", 0, 0, "gpu01", "DistBackendError('NCCL error')", NCCL_SYSTEM_ERROR,
                                 RetryPolicy(), lambda _: None, run=slurm)
    assert result.action == "requeue" and "submitted job 91 to go on after job 77" in result.message, result
    assert not slurm.called("requeue") and successor_of(run_dir, "77") == "91"
    (sbatch,) = [argv for argv in slurm.calls if Path(argv[0]).name == "sbatch"]
    assert "--dependency=afterany:77" in sbatch and not any(a.startswith("--exclude") for a in sbatch)
    (run_dir / "excluded_nodes.json").write_text(json.dumps({"nodes": [{"node": "n2", "class": "node_failure"}]}))
    moved = look_back(run_dir, "91", 0, RetryPolicy(), ["n2"], lambda _: None, run=slurm)
    assert moved.action == "requeue", moved
    assert "landed on excluded node(s) n2: submitted job 92 to go on after job 91" in moved.message
    assert "--exclude=n2" in [argv for argv in slurm.calls if Path(argv[0]).name == "sbatch"][-1]
    assert not slurm.called("update")  # no ExcNodeList on a job that never requeues
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "3")
    stopped = look_back(run_dir, "92", 0, RetryPolicy(), ["n2"], lambda _: None, run=slurm)
    assert stopped.action == "stop" and "a sweep's array task cannot go on as a new job" in stopped.message


def test_a_node_that_died_before_its_attempt_was_written(tmp_path: Path) -> None:
    """The last line of attempts.jsonl belongs to an older job: it is not rewritten, the node still excluded."""
    run_dir = _run_dir(tmp_path, outcome="completed")  # job 77 restart 0 completed long ago...
    slurm = FakeSlurm({**NODE_FAIL, "sacct --noheader": NODE_FAIL["sacct --noheader"].replace("77", "91")})
    result = look_back(run_dir, "91", 1, RetryPolicy(), ["n2"], lambda _: None, run=slurm)
    assert result.failure_class == "node_failure" and [e.node for e in read_exclusions(run_dir)] == ["n1"]
    [attempt] = AttemptLog(run_dir).read()
    assert attempt.outcome == "completed"


def test_a_new_submission_of_the_run_excludes_its_nodes(tmp_path: Path) -> None:
    from hpc_train.config.plan import load_job, make_plan
    from hpc_train.config.sites import load_site
    from tests.conftest import REPO

    run_dir = tmp_path / "runs" / "tiny-gpt"
    run_dir.mkdir(parents=True)
    (run_dir / "excluded_nodes.json").write_text(json.dumps({"nodes": [{"node": "n3"}, {"node": "n2"}]}))
    cfg = load_job(REPO / "examples" / "tiny_gpt.toml", ["job.exclude=n7"])
    plan = make_plan(cfg, load_site("local-slurm"), "slurm", cwd=tmp_path)
    assert plan.resources.exclude == "n[2-3,7]"


@pytest.mark.parametrize(("error", "mended"), [
    ("RuntimeError('NCCL error: unhandled system error, NET/IB : Got completion with error 12')", True),
    ("RuntimeError('[gloo/transport/tcp/pair.cc:537] Read error: Connection reset by peer')", True),
    ("RuntimeError('CUDA error: uncorrectable ECC error encountered')", False),  # this node's GPU: requeue, excluded
    ("ValueError('loss is nan')", False),  # the program's own: the same on every life
])
def test_an_in_place_restart_mends_network_faults_and_lost_peers_only(error: str, mended: bool) -> None:
    from hpc_train.failures.recovery import mended_in_place

    assert mended_in_place(1, "n2", error, f"Traceback (most recent call last):\n{error}\n") is mended


def test_the_look_back_after_a_network_error_excludes_no_node(tmp_path: Path) -> None:
    """The requeued attempt classifies the one before it as infrastructure again; a network error names no bad
    node (a 2-node job that excluded one could never start again)."""
    run_dir = _run_dir(tmp_path, outcome="failed")
    (run_dir / "logs" / "rank-1.error.json").write_text(json.dumps({
        "rank": 1, "host": "n2", "time": 10.0, "error": "DistBackendError('NCCL error')",
        "traceback": NCCL_SYSTEM_ERROR, "requeued": True}))
    slurm = FakeSlurm({"sacct --noheader": _sacct(("REQUEUED", "n[1-2]", "2026-11-30T03:20:46"),
                                                  ("RUNNING", "n[1-2]", "2026-11-30T03:21:06"))})
    result = look_back(run_dir, "77", 1, RetryPolicy(), ["n1", "n2"], lambda _: None, run=slurm)
    assert result.failure_class == "infrastructure" and result.action == "continue", result
    assert read_exclusions(run_dir) == [] and not slurm.called("ExcNodeList")


def _start(rank: int, restart: int) -> str:
    from hpc_train.run.loglines import format_start

    return f"2026-11-30 03:2{restart}:40,000 rank{rank} INFO " + format_start(
        "srun", rank, 200, 0, 1, rank, 200, "77", restart, "n1") + "\n"


def test_the_look_back_reads_only_the_ranks_that_left_a_record(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """O(failed ranks): of 50 nodes' logs (200 ranks), only the log of the one rank with an error record is read,
    and its GPU fault still excludes its node, though the rank has moved its record aside and logged this
    attempt's start line before rank 0 looked (as every rank of the requeued attempt does as it starts)."""
    from hpc_train.failures import evidence
    from hpc_train.run.error_records import keep_aside, ranks_with_records

    run_dir = _run_dir(tmp_path)
    for node in range(50):  # four ranks to a node's log
        (run_dir / "logs" / f"ranks-{4 * node}-{4 * node + 3}.log").write_text("".join(
            _start(rank, 0) for rank in range(4 * node, 4 * node + 4)) + "".join(
            _start(rank, 1) for rank in range(4 * node, 4 * node + 4)))
    (run_dir / "logs" / "rank-3.error.json").write_text(json.dumps(
        {"rank": 3, "host": "gpu017", "time": 1.0, "error": "RuntimeError('CUDA error')", "traceback": ECC_ERROR,
         "job_id": "77", "restart": 0}))
    keep_aside(run_dir, 3)
    read: list[str] = []
    real = evidence.read_tail
    monkeypatch.setattr(evidence, "read_tail", lambda path, *a: read.append(Path(path).name) or real(path, *a))
    failed = _sacct(("FAILED", "gpu017", "2026-11-30T03:20:46"), ("RUNNING", "n1", "2026-11-30T03:21:06"))
    result = look_back(run_dir, "77", 1, RetryPolicy(), ["n1"], lambda _: None, run=FakeSlurm(
        {"sacct --noheader": failed}), failed_ranks=ranks_with_records(run_dir))
    assert [name for name in read if name.startswith("ranks-")] == ["ranks-0-3.log"]
    assert result.failure_class == "infrastructure", result
    assert [e.node for e in read_exclusions(run_dir)] == ["gpu017"]
