"""Preemption on the real local Slurm cluster, 2 nodes, submitted through submitit: a job requeued from outside
with ``scontrol requeue`` and then preempted by a higher-priority job, one that reaches its time limit, a
Hugging Face GPT-2 sent ``scancel --signal=USR2``, a rank killed by SIGKILL (restarted inside the job), and a
rendered sbatch script that requeues itself. Each
(but the time limit, which stops once resumed) finishes, and its exported weights are bitwise identical to an
uninterrupted run of the same config (fp32, CPU)."""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from hpc_train.checkpoint.transaction import WRITTEN_OVER_COORDINATOR
from hpc_train.rank.runtime.malloc import MMAP_THRESHOLD, TRIM_THRESHOLD, SteadyHeap, describe
from hpc_train.run.node_log import log_ranks, rank_log_text
from hpc_train.run.watch import last_logged_step, slurm_job_processes, slurm_rank_pid
from tests.conftest import REPO, exported
from tests.rank.runtime.wandb_records import read_offline_run

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("slurm_cluster")]
EXAMPLE = str(REPO / "examples" / "tiny_gpt.toml")
STEPS = 60
BASE = ["--site", "local-slurm", "--set", "job.nodes=2", "--set", "job.tasks_per_node=1", "--set",
        "train.precision=fp32", "--set", "train.seq_len=64", "--set", "monitor.log_every=1", "--set",
        "monitor.eval_every=0", "--set", "train.warmup_steps=2", "--set", "checkpoint.every_steps=10"]
# 56 samples of 64 byte tokens (the first 3,585 bytes of examples/corpus/hpc_train_docs.txt through
# hpc_train.login.prepare): 3 global batches of 16 an epoch and 8 left over, so every run here crosses an epoch's
# end every 3 steps, and a smaller life's 8-sample micro-steps would take the left-over 8 if the sampler cut epochs
# by micro-step (the shrink test's weights would then leave the uninterrupted run's).
TOKENS = REPO / "tests" / "slurm" / "data" / "short-epochs.u16"
TINY = [*BASE, "--set", "data.source=tokens", "--set", f"data.path={TOKENS}"]  # BASE for the tiny GPT
# For runs that only requeue: each node's agent would start a standby rank (torch and DeepSpeed imported) 10 s into
# every life for a restart inside the job that never comes; the tests of in-place restarts keep them.
NO_STANDBY = ("--set", "retry.standby=false")
BAD_STATES = {"FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"}


def _submit(cwd: Path, steps: int, *extra: str, follow: bool = False, example: str = EXAMPLE) -> str:
    args = [sys.executable, "-m", "hpc_train.submit", example, *(TINY if example == EXAMPLE else BASE), "--set",
            f"train.steps={steps}", *extra]
    result = subprocess.run([*args, *([] if follow else ["--no-follow"])], cwd=cwd, capture_output=True, text=True,
                            timeout=300, check=False)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    (job_id,) = re.findall(r"submitted job (\d+)", result.stdout)
    return job_id


def _state(job_id: str) -> str:
    out = subprocess.run(["sacct", "-n", "-P", "-X", "-j", job_id, "-o", "State"], capture_output=True, text=True,
                         timeout=30, check=False).stdout.split()
    return out[-1].split()[0] if out else ""


def _logs(run_dir: Path) -> str:
    parts = [p.read_text(errors="replace")[-3000:] for p in sorted((run_dir / "logs").glob("rank*.log"))
             if log_ranks(p.name) is not None]  # each node's log (and any one-rank log of an older version)
    stacks = [p.read_text(errors="replace")[-6000:] for p in sorted((run_dir / "logs").glob("stacks-rank-*.txt"))]
    attempts = run_dir / "attempts.jsonl"
    return "\n".join([*parts, *stacks, attempts.read_text() if attempts.exists() else "no attempts.jsonl"])


def _wait_for_step(job_id: str, run_dir: Path, step: int, timeout_s: float = 180) -> None:
    deadline = time.monotonic() + timeout_s
    while last_logged_step(run_dir) < step:
        state = _state(job_id)
        assert state not in BAD_STATES | {"COMPLETED"}, f"job {job_id} {state} before step {step}\n{_logs(run_dir)}"
        assert time.monotonic() < deadline, f"job {job_id} did not reach step {step}\n{_logs(run_dir)}"
        time.sleep(0.2)


def _wait_until_completed(job_id: str, run_dir: Path, timeout_s: float = 420,
                          bad_states: set[str] = BAD_STATES) -> None:
    """Through any number of PREEMPTED / REQUEUED / PENDING rounds, until the job completes."""
    deadline = time.monotonic() + timeout_s
    while True:
        state = _state(job_id)
        attempts = _attempts(run_dir)
        if state == "COMPLETED" and attempts and attempts[-1]["outcome"] == "completed":
            return
        assert state not in bad_states, f"job {job_id} ended {state}\n{_logs(run_dir)}"
        if time.monotonic() > deadline:
            subprocess.run(["scancel", job_id], check=False)
            raise AssertionError(f"job {job_id} did not complete within {timeout_s} s ({state})\n{_logs(run_dir)}")
        time.sleep(1)


def _attempts(run_dir: Path) -> list[dict[str, object]]:
    path = run_dir / "attempts.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _exported(run_dir: Path, out: Path) -> dict[str, torch.Tensor]:
    return torch.load(exported(run_dir, out), weights_only=True)


def _assert_same(weights: dict[str, torch.Tensor], reference: dict[str, torch.Tensor], run_dir: Path) -> None:
    assert weights.keys() == reference.keys()
    different = [name for name, tensor in reference.items() if not torch.equal(weights[name], tensor)]
    assert not different, f"{len(different)} tensors differ, e.g. {different[:3]}\n{_logs(run_dir)}"


def _finished_run(run_dir: Path, job_id: str) -> list[dict[str, object]]:
    """The run's attempts once done: it ends completed at the last step, and every attempt after the first
    starts at the step of a checkpoint the one before it reached."""
    attempts = _attempts(run_dir)
    assert len(attempts) >= 2, f"the job was never interrupted\n{_logs(run_dir)}"
    assert attempts[-1]["outcome"] == "completed" and attempts[-1]["end_step"] == STEPS
    assert all(a["job_id"] == job_id for a in attempts)  # requeued, not resubmitted
    for before, after in itertools.pairwise(attempts):
        assert int(after["start_step"]) <= int(before["end_step"] or after["start_step"])
    return attempts


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    work = tmp_path_factory.mktemp("uninterrupted")
    _submit(work, STEPS, *NO_STANDBY, follow=True)
    return _exported(work / "runs" / "tiny-gpt", work / "weights.pt")


def test_a_hugging_face_gpt2_sent_usr2_by_scancel_exports_the_uninterrupted_weights(tmp_path: Path) -> None:
    """The HF GPT-2 example on FSDP2 (``train.engine = "fsdp2"``, tied weights, 2 nodes, 2 DataLoader workers
    per rank, W&B offline): ``scancel --signal=USR2``, saved, requeued by Slurm, resumed; the export is bitwise
    that of an uninterrupted run and loads strictly into ``GPT2LMHeadModel``, and both attempts are one W&B run
    with every step once. (ZeRO-2 on Slurm: the tiny GPT's tests below; the GPT-2 on ZeRO-2 preempted at random
    steps: tests/rank/train/test_hf_gpt2.py.)"""
    transformers = pytest.importorskip("transformers", reason="the hf extra (pip install 'hpc_train[hf]') is missing")
    tokens = tmp_path / "corpus.u16"
    subprocess.run([sys.executable, "-m", "hpc_train.login.prepare", str(REPO / "examples" / "corpus" /
                    "hpc_train_docs.txt"), str(tokens)], check=True, capture_output=True, timeout=60)
    hf = ["--set", f"data.path={tokens}", "--set", "data.num_workers=2", "--set", "checkpoint.every_steps=100",
          "--set", "monitor.eval_every=10", "--set", "train.engine=fsdp2", *NO_STANDBY]
    example = str(REPO / "examples" / "hf_gpt2" / "job.toml")
    plain, interrupted = tmp_path / "plain", tmp_path / "interrupted"
    plain.mkdir()
    interrupted.mkdir()
    _submit(plain, STEPS, *hf, follow=True, example=example)
    reference = _exported(plain / "runs" / "hf-gpt2", tmp_path / "reference.pt")
    run_dir = interrupted / "runs" / "hf-gpt2"
    seed = int(time.time())  # printed on failure: the step is reproducible
    at_step = random.Random(seed).randint(5, STEPS // 2)  # noqa: S311 - not a secret
    # a hang (one CI run stalled in the evaluation at step 50) leaves the watchdog's stacks for the message below
    job_id = _submit(interrupted, STEPS, *hf, "--set", "monitor.wandb=offline", "--set", "watchdog.step_timeout_s=120",
                     example=example)
    _wait_for_step(job_id, run_dir, at_step)
    subprocess.run(["scancel", "--signal=USR2", job_id], check=True, timeout=30)
    _wait_until_completed(job_id, run_dir)
    assert not [run for run in _attempts(run_dir) if run["outcome"] == "hang"], _logs(run_dir)
    first = _finished_run(run_dir, job_id)[0]
    assert first["outcome"] == "preempted" and first["signal"] == "SIGUSR2" and first["requeued"], (seed, first)
    assert _attempts(run_dir)[1]["start_step"] == first["end_step"]  # saved at the signal: no step lost
    weights = _exported(run_dir, tmp_path / "weights.pt")
    _assert_same(weights, reference, run_dir)
    config = transformers.GPT2Config(**{k: v for k, v in json.loads((run_dir / "model.json").read_text())[
        "hf_config"].items() if k not in ("architectures", "transformers_version")})
    transformers.GPT2LMHeadModel(config).load_state_dict(weights, strict=True)
    offline = [read_offline_run(path) for path in sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))]
    assert len(offline) == 2 and offline[0].run_id == offline[1].run_id, offline
    logged = [row["trainer/step"] for run in offline for row in run.history if "loss" in row]
    assert logged == list(range(1, STEPS + 1)), logged  # every step once: none lost, the replayed ones not twice


def test_requeued_from_outside_then_preempted_by_a_higher_priority_job(uninterrupted: dict[str, torch.Tensor],
                                                                       tmp_path: Path) -> None:
    """Slurm stops the run twice, each time its own way, and the run ends with the uninterrupted weights.
    First ``scontrol requeue``: no user signal, Slurm sends SIGTERM and requeues the job itself; the run saves on
    TERM (KillWait gives 30 s) and does not requeue itself on top. Then, once it has resumed, a job on the
    ``urgent`` partition preempts it (``preempt_send_user_signal``: USR2 within GraceTime, 30 s); it saves and
    comes back after the urgent job."""
    run_dir = tmp_path / "runs" / "tiny-gpt"
    # the attempt after the requeue (Slurm restart 1) is slowed (0.3 s a step), so that the urgent job preempts it
    # before it ends: unslowed its 40 steps took 3 s, and once the run completed before Slurm had preempted it
    job_id = _submit(tmp_path, STEPS, *NO_STANDBY, "--set", "env.HPC_TRAIN_INJECT_FAULT=slow:0:300", "--set",
                     "env.HPC_TRAIN_INJECT_FAULT_RESTART=1")
    _wait_for_step(job_id, run_dir, 15)
    subprocess.run(["scontrol", "requeue", job_id], check=True, timeout=30)
    deadline = time.monotonic() + 180
    while len(_attempts(run_dir)) < 2 or last_logged_step(run_dir) <= int(_attempts(run_dir)[1]["start_step"]):
        assert time.monotonic() < deadline, f"job {job_id} did not resume after scontrol requeue\n{_logs(run_dir)}"
        assert _state(job_id) not in BAD_STATES | {"COMPLETED"}, _logs(run_dir)
        time.sleep(0.2)
    urgent = subprocess.run(["sbatch", "--parsable", "-p", "urgent", "-N", "2", "--exclusive", "-t", "1",
                             "-o", str(tmp_path / "urgent.out"), "--wrap", "sleep 3"],
                            capture_output=True, text=True, check=True, timeout=30).stdout.strip()
    _wait_until_completed(job_id, run_dir)
    assert _state(urgent) == "COMPLETED"
    first, second, third = _finished_run(run_dir, job_id)[:3]
    assert first["outcome"] == "preempted" and first["signal"] == "SIGTERM" and not first["requeued"], first
    assert second["start_step"] == first["end_step"]
    assert second["outcome"] == "preempted" and second["signal"] in {"SIGUSR2", "SIGTERM"}, second
    assert third["start_step"] == second["end_step"]
    _assert_same(_exported(run_dir, tmp_path / "weights.pt"), uninterrupted, run_dir)


ONE_NODE = ["--set", "job.nodes=1", "--set", "job.tasks_per_node=2"]  # one node agent starting two ranks


@pytest.fixture(scope="module")
def uninterrupted_one_node(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    """The uninterrupted run on one node of two ranks: not bitwise the two nodes of one rank's (the ranks' CPU
    threads and gloo's paths differ), so a run of this layout is compared with it."""
    work = tmp_path_factory.mktemp("uninterrupted-one-node")
    _submit(work, STEPS, *ONE_NODE, *NO_STANDBY, follow=True)
    return _exported(work / "runs" / "tiny-gpt", work / "weights.pt")


def test_a_rank_killed_at_a_random_step_restarts_inside_the_same_job(uninterrupted: dict[str, torch.Tensor],
                                                                     tmp_path: Path) -> None:
    """Rank 1 dies of SIGKILL at a random step (no traceback, no signal handler runs). Its agent sees it, every
    rank starts again inside the same Slurm job (no requeue in sacct) from the last checkpoint, and the run ends
    with the uninterrupted weights."""
    seed = int(time.time())  # printed on failure: the step is reproducible
    at_step = random.Random(seed).randint(12, STEPS - 5)  # noqa: S311 - not a secret
    run_dir = tmp_path / "runs" / "tiny-gpt"
    # followed as users run it: the follower must not cancel the job while its ranks restart
    job_id = _submit(tmp_path, STEPS, "--set", "env.HPC_TRAIN_INJECT_FAULT=signal:1:9", "--set",
                     f"env.HPC_TRAIN_INJECT_FAULT_STEP={at_step}", "--set", "env.HPC_TRAIN_INJECT_FAULT_IN_PLACE=0",
                     follow=True)
    _wait_until_completed(job_id, run_dir)
    first, second = _finished_run(run_dir, job_id)
    assert first["outcome"] == "killed" and first["in_place"] == 0 and not first["requeued"], (seed, first)
    assert "SIGKILL" in str(first["note"]) and "restarted in place (1 of retry.in_place = 2)" in str(first["note"])
    assert second["in_place"] == 1 and second["restart"] == 0, (seed, second)  # the same Slurm attempt
    # the last checkpoint committed before the kill: the one before at_step, or the one before that when the kill
    # lands while that step's asynchronous save is still writing (a step later, on a loaded machine)
    newest_before = (at_step - 1) // 10 * 10
    assert second["start_step"] in (newest_before, newest_before - 10), (seed, second)
    rows = subprocess.run(["sacct", "-n", "-P", "-X", "-D", "-j", job_id, "-o", "State"], capture_output=True,
                          text=True, timeout=30, check=True).stdout.split()
    assert rows == ["COMPLETED"], rows  # never requeued: one allocation from start to end
    rank0 = rank_log_text(run_dir, 0)
    assert "in-place restart 1 of 2 (retry.in_place): killed" in rank0
    assert WRITTEN_OVER_COORDINATOR in rank0  # the written records came over the coordinator, not as files
    # every life of rank 0 under srun fixed glibc's thresholds as it started (rank/runtime/malloc.py)
    lines = rank0.splitlines()
    starts = [index for index, line in enumerate(lines) if "start: " in line and " rank 0/" in line]
    assert len(starts) >= 2, starts  # the first life and the one restarted in place
    heap = describe(SteadyHeap(MMAP_THRESHOLD, TRIM_THRESHOLD))
    assert all(heap in lines[index + 1] for index in starts), [lines[index:index + 2] for index in starts]
    _assert_same(_exported(run_dir, tmp_path / "weights.pt"), uninterrupted, run_dir)


def test_a_rank_killed_once_the_standbys_are_ready_restarts_warm_with_the_uninterrupted_weights(
        uninterrupted: dict[str, torch.Tensor], tmp_path: Path) -> None:
    """``retry.standby`` (on by default): once each node's agent says its standby rank is ready (imports done),
    rank 1 is killed from outside; rank 1's place goes to a standby, rank 0 trains on in its own process (or a
    standby takes it), and the run ends with the uninterrupted weights, bit for bit. Rank 0's first life is
    slowed (1 s per step) so that the kill lands well before the end."""
    run_dir = tmp_path / "runs" / "tiny-gpt"
    job_id = _submit(tmp_path, STEPS, "--set", "env.HPC_TRAIN_INJECT_FAULT=slow:0:1000", "--set",
                     "env.HPC_TRAIN_INJECT_FAULT_IN_PLACE=0")
    deadline = time.monotonic() + 240
    while not all("standby rank(s) ready for the next life" in rank_log_text(run_dir, rank) for rank in (0, 1)):
        assert _state(job_id) not in BAD_STATES | {"COMPLETED"}, _logs(run_dir)
        assert time.monotonic() < deadline, f"no standby said it was ready\n{_logs(run_dir)}"
        time.sleep(0.5)
    assert last_logged_step(run_dir) < STEPS - 5, "the run nearly ended before its standbys were ready"
    pid = slurm_rank_pid(job_id, 1)
    assert pid is not None, f"no rank 1 of job {job_id} runs\n{_logs(run_dir)}"
    os.kill(pid, signal.SIGKILL)
    _wait_until_completed(job_id, run_dir)
    first, second = _finished_run(run_dir, job_id)
    assert first["outcome"] == "killed" and second["in_place"] == 1 and second["restart"] == 0, (first, second)
    said = rank_log_text(run_dir, 1)
    assert "1 rank(s) of this node started from standby processes (imports done)" in said, _logs(run_dir)
    # rank 0 trains the next life in its own process once its collective on rank 1 fails (a warm restart); when
    # its slowed step keeps it out of collectives past its agent's wait, a standby takes its place instead
    said = rank_log_text(run_dir, 0)
    assert "1 rank(s) of this node restarted warm" in said or \
        "1 rank(s) of this node started from standby processes" in said, _logs(run_dir)
    _assert_same(_exported(run_dir, tmp_path / "weights.pt"), uninterrupted, run_dir)


def test_a_rank_killed_under_the_srun_template_restarts_inside_the_same_job(
        uninterrupted_one_node: dict[str, torch.Tensor], tmp_path: Path) -> None:
    """The same kill through a rendered srun script (no submitit), here on one node of two ranks: its one task's
    agent (``python -m hpc_train.agent``) starts both, sees rank 1 killed, starts both again inside the job, and
    the run ends with the uninterrupted run's weights, bit for bit."""
    rendered = subprocess.run([sys.executable, "-m", "hpc_train", "render", EXAMPLE, *TINY, *ONE_NODE, "--set",
                               f"train.steps={STEPS}", "--template", "srun", "--set",
                               "env.HPC_TRAIN_INJECT_FAULT=signal:1:9", "--set", "env.HPC_TRAIN_INJECT_FAULT_STEP=23",
                               "--set", "env.HPC_TRAIN_INJECT_FAULT_IN_PLACE=0", "--json"], cwd=tmp_path,
                              capture_output=True, text=True, timeout=60, check=True)
    script = json.loads(rendered.stdout)["script"]
    text = Path(script).read_text()
    assert "-m hpc_train.agent" in text and "#SBATCH --ntasks-per-node=1\n" in text, text  # one task: the node's
    job_id = subprocess.run(["sbatch", "--parsable", script], capture_output=True, text=True, check=True,
                            timeout=30).stdout.strip().split(";")[0]
    run_dir = tmp_path / "runs" / "tiny-gpt"
    _wait_until_completed(job_id, run_dir)
    first, second = _finished_run(run_dir, job_id)
    assert first["outcome"] == "killed" and "restarted in place" in str(first["note"]), first
    assert second["in_place"] == 1 and second["start_step"] in (20, 10), second  # 10: step 20's save still writing
    rows = subprocess.run(["sacct", "-n", "-P", "-X", "-D", "-j", job_id, "-o", "State"], capture_output=True,
                          text=True, timeout=30, check=True).stdout.split()
    assert rows == ["COMPLETED"], rows
    logs = sorted(path.name for path in (run_dir / "logs").iterdir())
    assert "ranks-0-1.log" in logs and not [name for name in logs if name.startswith("rank-")], logs
    _assert_same(_exported(run_dir, tmp_path / "weights.pt"), uninterrupted_one_node, run_dir)


def test_time_limit(tmp_path: Path) -> None:
    """A 2-minute job asking for its signal 60 s ahead, with steps slowed to 1.2 s (rank 0 sleeps in each
    forward pass, ``HPC_TRAIN_INJECT_FAULT=slow:0:1200``), so that its 60 steps outlast the first attempt: Slurm
    sends the signal as the time runs out, the run saves and requeues itself, and the next attempt starts at the
    saved step. (That such a resume ends bitwise where an uninterrupted run ends, the other tests here show; the
    time limit adds only who sends the signal, so the test stops once the second attempt has resumed.)"""
    run_dir = tmp_path / "runs" / "tiny-gpt"
    job_id = _submit(tmp_path, STEPS, *NO_STANDBY, "--set", "job.time=00:02:00", "--set", "preempt.lead_seconds=60",
                     "--set", "env.HPC_TRAIN_INJECT_FAULT=slow:0:1200")
    try:
        deadline = time.monotonic() + 300
        while len(_attempts(run_dir)) < 2 or _attempts(run_dir)[1]["outcome"] != "running" \
                or last_logged_step(run_dir) <= int(_attempts(run_dir)[1]["start_step"]):
            state = _state(job_id)
            assert state not in BAD_STATES | {"COMPLETED"}, f"job {job_id} {state}\n{_logs(run_dir)}"
            assert time.monotonic() < deadline, f"job {job_id} was not requeued by its time limit\n{_logs(run_dir)}"
            time.sleep(0.5)
    finally:
        subprocess.run(["scancel", job_id], check=False, timeout=30)
    first, second = _attempts(run_dir)[:2]
    assert first["outcome"] == "preempted" and first["signal"] == "SIGUSR2" and first["requeued"], first
    assert first["job_id"] == second["job_id"] == job_id  # requeued, not resubmitted
    assert 0 < first["end_step"] < STEPS and second["start_step"] == first["end_step"]  # saved at the signal


def test_rendered_sbatch_script_requeues_itself(uninterrupted: dict[str, torch.Tensor], tmp_path: Path) -> None:
    """The sbatch path has no submitit: rank 0 runs ``scontrol requeue`` itself and Slurm runs the script again.
    Under torchrun the signal reaches the agent too, which must survive it (it ignores it) for the ranks to save.
    (The srun template runs the same ranks without the agent: tests/slurm/test_user_code_e2e.py runs it.)"""
    template = "torchrun"
    rendered = subprocess.run([sys.executable, "-m", "hpc_train", "render", EXAMPLE, *TINY, "--set",
                               f"train.steps={STEPS}", "--template", template, "--json"], cwd=tmp_path,
                              capture_output=True, text=True, timeout=60, check=True)
    script = json.loads(rendered.stdout)["script"]
    job_id = subprocess.run(["sbatch", "--parsable", script], capture_output=True, text=True, check=True,
                            timeout=30).stdout.strip().split(";")[0]
    run_dir = tmp_path / "runs" / "tiny-gpt"
    _wait_for_step(job_id, run_dir, 15)
    subprocess.run(["scancel", "--signal=USR2", job_id], check=True, timeout=30)
    _wait_until_completed(job_id, run_dir)
    first = _finished_run(run_dir, job_id)[0]
    assert first["outcome"] == "preempted" and first["requeued"] and first["note"] == f"scontrol requeue {job_id}"
    _assert_same(_exported(run_dir, tmp_path / "weights.pt"), uninterrupted, run_dir)


def _norequeue_site(tmp_path: Path) -> Path:
    """The local site as one that forbids requeue: the next attempt is a new job (``[slurm] requeue``)."""
    site = tmp_path / "norequeue.toml"
    site.write_text((REPO / "site_configs" / "local-slurm.toml").read_text()
                    .replace('name = "local-slurm"', 'name = "norequeue"')
                    .replace("[slurm]\n", '[slurm]\nrequeue = "dependency"\n', 1))
    return site


def test_where_requeue_is_forbidden_a_preempted_job_goes_on_as_a_new_job(uninterrupted: dict[str, torch.Tensor],
                                                                         tmp_path: Path) -> None:
    """A site with ``[slurm] requeue = "dependency"`` (its jobs are submitted ``--no-requeue``, as where the
    partition disables requeue): after USR2, rank 0 submits the job's own batch script again with
    ``--dependency=afterany``. The follower goes on with the new job id, which resumes from the saved step, and
    the run ends with the uninterrupted weights. ``status`` shows one run with both job ids."""
    site = _norequeue_site(tmp_path)
    run_dir = tmp_path / "runs" / "tiny-gpt"
    args = [sys.executable, "-m", "hpc_train.submit", EXAMPLE, *TINY, "--site", str(site), "--set",
            f"train.steps={STEPS}", *NO_STANDBY, "--set", "env.HPC_TRAIN_INJECT_FAULT=slow:0:60"]
    follower = subprocess.Popen(args, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 180
        while not (run_dir / "attempts.jsonl").exists() or last_logged_step(run_dir) < 15:
            assert follower.poll() is None and time.monotonic() < deadline, _logs(run_dir)
            time.sleep(0.2)
        first_job = str(_attempts(run_dir)[0]["job_id"])
        shown = subprocess.run(["scontrol", "show", "job", first_job], capture_output=True, text=True, timeout=30,
                               check=True).stdout
        assert "Requeue=0" in shown, shown  # submitted --no-requeue: scontrol requeue is not how it goes on
        subprocess.run(["scancel", "--signal=USR2", first_job], check=True, timeout=30)
        out, _ = follower.communicate(timeout=420)
    finally:
        if follower.poll() is None:
            follower.kill()
    assert follower.returncode == 0, out[-4000:] + _logs(run_dir)
    first, second = _attempts(run_dir)
    second_job = str(second["job_id"])
    assert second_job != first_job and f"job {first_job}: goes on as job {second_job}" in out, out[-3000:]
    assert first["outcome"] == "preempted" and first["requeued"], first
    assert f"submitted job {second_job} to go on after job {first_job}" in str(first["note"]), first
    assert second["outcome"] == "completed" and second["start_step"] == first["end_step"], second
    for job in (first_job, second_job):  # two jobs, each run once: never requeued
        rows = subprocess.run(["sacct", "-n", "-P", "-X", "-D", "-j", job, "-o", "State"], capture_output=True,
                              text=True, timeout=30, check=True).stdout.split()
        assert rows == ["COMPLETED"], (job, rows)
    status = subprocess.run([sys.executable, "-m", "hpc_train", "status", str(run_dir), "--json"], cwd=tmp_path,
                            capture_output=True, text=True, timeout=60, check=True)
    (run,) = json.loads(status.stdout)["runs"]
    assert run["job_ids"] == [first_job, second_job] and run["job_id"] == second_job, run
    _assert_same(_exported(run_dir, tmp_path / "weights.pt"), uninterrupted, run_dir)


def test_where_requeue_is_forbidden_a_job_that_landed_on_an_excluded_node_hands_the_run_on_and_ends(
        tmp_path: Path) -> None:
    """A ``retry.shrink`` job (its srun does not kill the other tasks when one leaves) held on n1,n2 while n1 is
    excluded, then released: rank 0's look-back submits the next job with ``--exclude`` and leaves. Rank 1,
    waiting in its rendezvous for rank 0, is ended by its agent, not left to hold both nodes; the next job runs on
    n2,n3 and completes, and ``status`` shows one run with both job ids."""
    from hpc_train.run.chain import successor_of
    from hpc_train.run.exclusions import add_exclusions

    rendered = subprocess.run([sys.executable, "-m", "hpc_train", "render", EXAMPLE, *TINY, "--site",
                               str(_norequeue_site(tmp_path)), "--set", "train.steps=20", "--set", "retry.shrink=true",
                               "--set", "job.partition=spares", "--template", "srun", "--json"],
                              cwd=tmp_path, capture_output=True, text=True, timeout=60, check=True)
    script = json.loads(rendered.stdout)["script"]
    first = subprocess.run(["sbatch", "--parsable", "--hold", "--nodelist=n1,n2", script], capture_output=True,
                           text=True, check=True, timeout=30).stdout.strip().split(";")[0]
    run_dir = tmp_path / "runs" / "tiny-gpt"
    add_exclusions(run_dir, ["n1"], "node_failure", "0", "excluded before this job started (test)")
    subprocess.run(["scontrol", "release", first], check=True, timeout=30)
    deadline = time.monotonic() + 90
    while _state(first) in ("", "PENDING", "RUNNING", "COMPLETING"):
        if time.monotonic() > deadline:
            subprocess.run(["scancel", first], check=False)
            raise AssertionError(f"job {first} still holds its nodes\n{_logs(run_dir)}")
        time.sleep(0.5)
    second = successor_of(run_dir, first)
    assert second is not None, _logs(run_dir)
    _wait_until_completed(second, run_dir, timeout_s=240)
    nodes = subprocess.run(["sacct", "-n", "-P", "-X", "-j", second, "-o", "NodeList"], capture_output=True,
                           text=True, timeout=30, check=True).stdout.split()
    assert nodes == ["n[2-3]"], nodes
    rank1 = rank_log_text(run_dir, 1)
    assert f"ending the ranks of node n2: this job's run goes on as job {second}" in rank1, rank1[-3000:]
    assert f"landed on excluded node(s) n1: submitted job {second}" in rank_log_text(run_dir, 0)
    status = subprocess.run([sys.executable, "-m", "hpc_train", "status", str(run_dir), "--json"], cwd=tmp_path,
                            capture_output=True, text=True, timeout=60, check=True)
    (run,) = json.loads(status.stdout)["runs"]
    assert run["job_ids"] == [first, second] and run["job_id"] == second, run


def _text(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""


def _lose_n2_mid_run(tmp_path: Path, *settings: str, slow_ms: int = 60,
                     ready: Callable[[Path], bool] = lambda _run_dir: True) -> tuple[str, Path]:
    """Submit the rendered srun script with ``settings`` (rank 0 slowed to ``slow_ms`` a step), and at step 15,
    once ``ready(run_dir)``, lose node n2 the way a node is lost: drained, and every process of the job on it
    killed. Returns the job id and the run folder once the job has ended; n2 is resumed afterwards whatever
    happened."""
    sets = [arg for setting in settings for arg in ("--set", setting)]
    rendered = subprocess.run([sys.executable, "-m", "hpc_train", "render", EXAMPLE, *TINY, "--set",
                               f"train.steps={STEPS}", *sets, "--set", f"env.HPC_TRAIN_INJECT_FAULT=slow:0:{slow_ms}",
                               "--template", "srun", "--json"],
                              cwd=tmp_path, capture_output=True, text=True, timeout=60, check=True)
    script = json.loads(rendered.stdout)["script"]
    job_id = subprocess.run(["sbatch", "--parsable", script], capture_output=True, text=True, check=True,
                            timeout=30).stdout.strip().split(";")[0]
    run_dir = tmp_path / "runs" / "tiny-gpt"
    try:
        _wait_for_step(job_id, run_dir, 15)
        deadline = time.monotonic() + 120
        while not ready(run_dir):
            assert time.monotonic() < deadline and _state(job_id) not in BAD_STATES | {"COMPLETED"}, _logs(run_dir)
            time.sleep(0.2)
        subprocess.run(["scontrol", "update", "NodeName=n2", "State=DRAIN", "Reason=hpc_train-test-lost-node"],
                       check=True, timeout=30)
        for pid in slurm_job_processes(job_id, "n2"):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        _wait_until_completed(job_id, run_dir)
    finally:
        subprocess.run(["scontrol", "update", "NodeName=n2", "State=RESUME"], check=False, timeout=30)
    return job_id, run_dir


def test_a_lost_node_is_replaced_by_a_hot_spare_inside_the_same_job(uninterrupted: dict[str, torch.Tensor],
                                                                   tmp_path: Path) -> None:
    """A 2-node job with one spare (``job.spare_nodes = 1``, the 3-node ``spares`` partition), through the
    rendered srun script. Mid-run node n2 is drained and every process of the job on it is killed, as when a
    node is lost: rank 0's agent restarts in place, n2's agents never answer, and the spare n3 takes rank 1. The
    job is never requeued, completes, excludes n2, and ends with the uninterrupted weights. The memory tier copies
    each rank's state every 5 steps (``checkpoint.memory_every_steps``), and n2's agent each copy to the next node,
    the spare n3: the node is lost once rank 1's first copy reached n3, and rank 1 resumes on n3 from that replica
    (at least as new as the disk's step 10, which it is read instead of)."""
    job_id, run_dir = _lose_n2_mid_run(
        tmp_path, "job.spare_nodes=1", "job.partition=spares", "checkpoint.memory_every_steps=5", slow_ms=150,
        ready=lambda run_dir: "memory tier: rank 1's step" in _text(run_dir / "logs" / "agents-1-1.log"))
    first, second = _finished_run(run_dir, job_id)
    assert first["in_place"] == 0 and second["in_place"] == 1 and second["restart"] == 0, (first, second)
    assert "restarted in place (1 of retry.in_place = 2)" in str(first["note"]), first
    rows = subprocess.run(["sacct", "-n", "-P", "-X", "-D", "-j", job_id, "-o", "State"], capture_output=True,
                          text=True, timeout=30, check=True).stdout.split()
    assert rows == ["COMPLETED"], rows  # never requeued; the lost node's task did not fail the job
    assignment = json.loads((run_dir / "heartbeats" / f"assign-{job_id}.0.1.json").read_text())
    assert assignment["nodes"] == ["n1", "n3"] and assignment["lost"] == ["n2"], assignment
    excluded = json.loads((run_dir / "excluded_nodes.json").read_text())
    assert [entry["node"] for entry in excluded["nodes"]] == ["n2"], excluded
    log = rank_log_text(run_dir, 0)
    assert "ranks on n1,n3 (spare n3 for lost n2)" in log, log[-3000:]
    resumed = re.search(r"resumed from memory at step (\d+) in [\d.]+ s: 1 rank\(s\) from their node's memory, "
                        r"1 from a replica on another node", log)
    assert resumed and int(resumed[1]) >= 10 and second["start_step"] == int(resumed[1]), log[-3000:]
    _assert_same(_exported(run_dir, tmp_path / "weights.pt"), uninterrupted, run_dir)


def test_with_no_spare_left_a_lost_node_s_job_goes_on_at_half_the_size(uninterrupted: dict[str, torch.Tensor],
                                                                       tmp_path: Path) -> None:
    """``retry.shrink`` on 2 nodes and no spare, through the rendered srun script: n2 is drained and its processes
    are killed mid-run. The agent on n1 goes on alone inside the same job at data-parallel size 1 with twice the
    accumulation (the same global batch), resumes the 2-rank checkpoint through DeepSpeed's universal checkpoint,
    and completes; the job is never requeued, n2 is excluded, and the weights follow the uninterrupted run's
    (sums over another number of ranks round in another order: not bitwise)."""
    job_id, run_dir = _lose_n2_mid_run(tmp_path, "retry.shrink=true")
    first, second = _finished_run(run_dir, job_id)
    assert first["in_place"] == 0 and second["in_place"] == 1 and second["restart"] == 0, (first, second)
    rows = subprocess.run(["sacct", "-n", "-P", "-X", "-D", "-j", job_id, "-o", "State"], capture_output=True,
                          text=True, timeout=30, check=True).stdout.split()
    assert rows == ["COMPLETED"], rows
    assignment = json.loads((run_dir / "heartbeats" / f"assign-{job_id}.0.1.json").read_text())
    assert assignment["nodes"] == ["n1"] and assignment["lost"] == ["n2"], assignment
    excluded = json.loads((run_dir / "excluded_nodes.json").read_text())
    assert [entry["node"] for entry in excluded["nodes"]] == ["n2"], excluded
    log = rank_log_text(run_dir, 0)
    assert ("ranks on n1 (retry.shrink: 2 -> 1 nodes without lost n2; data parallel 2 -> 1, grad_accum 1 -> 2, "
            "global batch kept)") in log, log[-3000:]
    assert "start: srun rank 0/1" in log and "universal" in log, log[-3000:]
    weights = _exported(run_dir, tmp_path / "weights.pt")
    assert weights.keys() == uninterrupted.keys()
    apart = max(float((weights[name] - tensor).abs().max()) for name, tensor in uninterrupted.items())
    assert apart < 1e-4, f"{apart} from the uninterrupted weights\n{_logs(run_dir)}"
