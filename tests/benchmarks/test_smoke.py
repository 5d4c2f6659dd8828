"""Every benchmark in benchmarks/ runs end to end in its smoke mode (``--smoke``: tiny sizes, one repetition, every
measured side and its baseline, the report printed), so that none can break silently again (checkpoint.py once
did, after a rename). Figures are not checked: only the exit status, the report's key lines, and that nothing was
left in the repository. gpu_check.py has its own test (test_gpu_check.py: --cpu-dry-run, which also runs
gpu_baseline.py and gpu_relife.py); user_code_loop.py runs under user_code.py; library_preemption.py runs whole, as
tests/integrations/test_preemption_slurm.py (its six Slurm runs are that test). ``user_code.py --only slurm`` (a
requeue round trip on the cluster, about 100 s of Slurm's credential and scheduler waits even when tiny) is left
to a manual run: CI's time is spent on its local parts and on the cluster's end-to-end tests of the same requeue.

The runs on this machine start together when the first test asks for one, two at a time, because one after
another they would take several minutes of CI; each test then waits for its own run. A benchmark that submits
to the local Slurm cluster runs in its own test in the Slurm lane instead (its jobs take the nodes: started beside
the Slurm lane's tests, they once left another test's job pending until that test gave up).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import pytest

from tests.conftest import PYTHON, REPO
from tests.slurm.cluster import slurm_cluster

__all__ = ["slurm_cluster"]  # the fixture (skip, or fail where HPC_TRAIN_REQUIRE_SLURM=1), asked for by name

pytestmark = pytest.mark.slow


@dataclass(frozen=True)
class Case:
    script: str
    args: tuple[str, ...]
    lines: tuple[str, ...]  # regular expressions, each must match a whole line of the report (stdout)
    slurm: bool = False
    timeout_s: float = 480

    @property
    def id(self) -> str:
        return " ".join((self.script, *self.args))


NUMBER = r"[\d.]+"
SOME = r"\d*\.\d*[1-9]\d*"  # a time above zero: measured, not bounded (a loaded machine is slower)
MACHINE = r"machine: .+, \d+ CPUs, native bf16 (yes|no), load average [\d.]+ at the start; python .+"
SPREAD = rf"{NUMBER} \(min {NUMBER}, max {NUMBER}, \d+ runs?\)"
CASES = [  # the costliest first (CPU seconds here: 57, 52, 25, 23, 22, 14, 4, 0; Slurm: 23 s)
    Case("user_code.py", (), (r"\(a\) submit to the first step: .*", r"torchrun --nproc_per_node=2 .*",
                              r"submitit LocalExecutor, Checkpointable .*", r"async_all_reduce .*",
                              rf"should_stop\(\) against the plain loop: {NUMBER} .*")),
    Case("user_model.py", (), (rf"median: hpc_train {NUMBER} ms/step, raw DeepSpeed loop {NUMBER} ms/step, ratio .*",
                               rf"run 1: compute only {NUMBER} ms/step; num_workers=0 .*; num_workers=2 .*")),
    Case("preemption.py", (), (r"run 1: signal after step \d+, saved step \d+, .*; completed: True",
                               rf"signal to durable checkpoint: median {NUMBER} s, .*ratio {NUMBER}\)",
                               r"steps lost per preemption: max \d+ \(target 0\)")),
    Case("trainer_overhead.py", ("--raw-steady-heap",), (
        MACHINE, r".*ZeRO-2, .*; the raw loop's malloc thresholds: fixed as hpc_train fixes them",
        rf"hpc_train\s+{NUMBER}\s+{NUMBER}\s+{NUMBER}", rf"raw DeepSpeed loop\s+{NUMBER}\s+{NUMBER}\s+1\.000",
        rf"ratio hpc_train / raw DeepSpeed loop, run by run: {SPREAD}; target <= 1\.01")),
    Case("checkpoint.py", ("--json",), (MACHINE, rf"save, synchronous, whole transaction\s+{NUMBER}\s+.*",
                                        r"raw writes .*", rf"load_ratio over the repetitions: {SPREAD}",
                                        rf"sha256 alone of the same bytes \(hashlib\)\s+{NUMBER} .*",
                                        r"load \(resume\), (cold|WARM) cache.*", r"async save: stall .*",
                                        rf"of it the next step waiting for the copies\s+{NUMBER}",
                                        r'\{"ranks": 2, .*"save_ratio": .*"load_ratio": .*"async_stall_ratio": .*')),
    Case("checkpoint.py", ("--engine", "fsdp2", "--profile"), (
        r"GPT .* ranks, FSDP2 \(DCP shards\), .*", rf"save, synchronous, whole transaction\s+{NUMBER}\s+.*",
        r"load \(resume\), (cold|WARM) cache.*", r"async save: stall .*",
        r"profile of one more save on rank 0 .*", rf"DCP write_data \(serialize and write the shards\)\s+{SOME}",
        r"profile of one more load on rank 0 .*", rf"torch\.load of each tensor \(one per item\)\s+{SOME}")),
    Case("cpu_determinism.py", (), (MACHINE, r"threads\s+processes\s+distinct results\s+off the majority\s+ms/step",
                                    rf"1\s+2\s+\d\s+\d\s+{NUMBER}")),
    Case("flag_rounds.py", (), (MACHINE, rf"none\s+{NUMBER}\s+1\.000", rf"every step\s+{NUMBER}\s+{NUMBER}",
                                rf"rounds\s+{NUMBER}\s+{NUMBER}")),
    Case("idle_groups.py", (), (MACHINE, rf"default only\s+{NUMBER}\s+1\.000", rf"5 more, idle\s+{NUMBER}\s+{NUMBER}")),
    Case("bootstrap.py", (), (rf"hpc_train bootstrap\s+{NUMBER} \(.*\)\s+{NUMBER}x",
                              rf"bare init_process_group\s+{NUMBER} \(.*\)\s+1\.00x")),
    Case("cli_latency.py", (), (rf"python -c pass \(baseline\)\s+{NUMBER}\s+{NUMBER}\s+1\.0\s+\w+",
                                r"render --stdout \(local-slurm\)\s+.*")),
    Case("log_call.py", (), (rf"hpc_train Monitor\.scalars \+ health\s+{NUMBER}\s+{NUMBER}",
                             rf"own json\.dumps \+ write \(baseline\)\s+{NUMBER}\s+1\.00")),
    Case("fsdp2.py", (), (rf"2\s+zero3\s+{NUMBER}\s+1\.000\s+{NUMBER}\s+1\.000",
                          rf"2\s+fsdp2\s+{NUMBER}\s+{NUMBER}\s+{NUMBER}\s+{NUMBER}")),
    Case("rank_start.py", (), (r"run 1: trainer start to first step [\d.]+ s; imports [\d.]+ s",
                                rf"\(b\) trainer start to first step: median {NUMBER} s; import floor {NUMBER} s; .*")),
    Case("control_plane.py", ("--section", "login"), (
        r"section\s+ranks\s+what\s+wall s\s+CPU s\s+peak MiB\s+x smallest\s+\(ranks x\)\s+target",
        rf"login\s+256\s+status --json\s+{NUMBER}\s+{NUMBER}\s+{NUMBER}\s+{NUMBER}\s+4\s+\w+",
        rf"login\s+256\s+logs --errors-only --tail 20\s+{NUMBER}\s+.*", rf"login\s+256\s+classifier\s+{NUMBER}\s+.*",
        rf"login\s+256\s+follower's poll\s+{NUMBER}\s+.*", rf"login\s+256\s+look-back \(rank 0\)\s+{NUMBER}\s+.*")),
    Case("control_plane.py", ("--section", "coordinator"), (
        r"coordinator: 4 nodes, 4 agents: start [\d.]+ s, restart decided [\d.]+ ms after the notice .*",
        rf"coord\s+4\s+restart decided, a node lost\s+{NUMBER}\s+.*")),
    Case("topology.py", (), (r"layout\s+hpc_train s\s+brute force s\s+ratio\s+target",
                             rf"64 ranks \(tp 2, pp 4, dp 8\)\s+{NUMBER}\s+{NUMBER}\s+{NUMBER}\s+\w+")),
    Case("submit_latency.py", (), (r"hpc_train\.submit\s+.*", r"hand-written sbatch\s+.*\s+1\.00\s+.*\s+1\.00"),
         slurm=True),
    Case("api_vs_submitit.py", (), (r"hpc_train\s+first line: min .*", r"submitit\s+first line: min .*",
                                    r"ratio hpc_train / submitit \(medians\): first line [\d.]+, result [\d.]+ .*"),
         slurm=True),
    Case("standby_restart.py", (), (MACHINE, rf"standby\s+{NUMBER}\s+{NUMBER}\s+{NUMBER}\s+\d+\s+(yes|no)",
                                     rf"cold\s+{NUMBER}\s+{NUMBER}\s+{NUMBER}\s+\d+\s+no",
                                     r"kill -9 to the next first step \(medians\), standby / cold: [\d.]+ .*"),
         slurm=True),
    Case("memory_restart.py", (), (MACHINE, rf"kill/memory\s+{NUMBER}\s+{NUMBER}\s+{NUMBER}\s+\d+",
                                    rf"kill/disk\s+{NUMBER}\s+{NUMBER}\s+{NUMBER}\s+\d+",
                                    r"one rank's copy in memory: [\d.]+ MB .*"), slurm=True),
    Case("control_plane.py", ("--section", "cluster"), (
        r"cluster: steady training: [\d.]+ run-folder operations per rank per second",
        r"cluster: a restart in place \(rank 1 killed\): [\d.]+ run-folder operations per rank per second",
        r"cluster: files per node outside checkpoints/, saving job: [\d.]+"), slurm=True),
]
# Run in the Slurm lane by their own test (tests/conftest.py puts a test that asks for slurm_cluster there): their
# jobs take the nodes, and started beside the Slurm lane's tests they left another test's job pending.
SLURM_CASES = [case for case in CASES if case.slurm]
CASES = [case for case in CASES if not case.slurm]
LOCAL_LANES = 2


def _untracked() -> set[str]:
    """The repository's untracked files, ignored ones not counted (git status). Changes to tracked files are not
    compared: in a shared working tree they are other people's edits, and what a run leaves is a new file."""
    if not (REPO / ".git").exists():  # not a checkout: nothing to compare
        return set()
    out = subprocess.run(["git", "status", "--porcelain", "--untracked-files=all"], cwd=REPO, capture_output=True,
                         text=True, check=True, timeout=60).stdout
    return {line[3:] for line in out.splitlines() if line.startswith("?? ")}


@dataclass
class Result:
    code: int
    out: str
    err: str
    seconds: float


class Runs:
    """Every case of ``cases`` started, LOCAL_LANES at a time; ``result(case)`` waits for one."""

    def __init__(self, cases: list[Case]) -> None:
        self.before = _untracked()
        # The environment as the module found it, given to every run: these threads start processes while other
        # tests of the same worker may set variables (monkeypatch.setenv), and a process started from a thread
        # with the live environment meets it half rewritten (execve once failed with EFAULT) or inherits a
        # variable meant for another test.
        self._env = dict(os.environ)
        self._procs: set[subprocess.Popen[str]] = set()
        self._lock = threading.Lock()
        self._pools = [ThreadPoolExecutor(LOCAL_LANES)]
        self.futures: dict[Case, Future[Result]] = {case: self._pools[0].submit(self._run, case) for case in cases}

    def _run(self, case: Case) -> Result:
        return _run_case(case, self._track, self._env)

    def _track(self, proc: subprocess.Popen[str], running: bool) -> None:
        with self._lock:
            (self._procs.add if running else self._procs.discard)(proc)

    def result(self, case: Case) -> Result:
        return self.futures[case].result()

    def close(self) -> None:
        """After the tests, nothing is left running (an interrupted session's runs included)."""
        for pool in self._pools:
            pool.shutdown(wait=False, cancel_futures=True)
        with self._lock:
            running = list(self._procs)
        for proc in running:
            _stop(proc)
        for pool in self._pools:
            pool.shutdown(wait=True)


def _run_case(case: Case, track: Callable[[subprocess.Popen[str], bool], None] = lambda proc, running: None,
              env: dict[str, str] | None = None) -> Result:
    """``benchmarks/SCRIPT --smoke``, in a session of its own: on a timeout the whole group goes (its ranks too),
    SIGINT first so that a benchmark cancels its Slurm jobs."""
    start = time.monotonic()
    proc = subprocess.Popen([PYTHON, f"benchmarks/{case.script}", "--smoke", *case.args], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env=env)
    track(proc, True)
    try:
        out, err = proc.communicate(timeout=case.timeout_s)
    except subprocess.TimeoutExpired:
        _stop(proc)
        out, err = proc.communicate()
        err += f"\n[test_smoke: killed after {case.timeout_s:.0f} s]"
    finally:
        track(proc, False)
    return Result(proc.returncode, out, err, time.monotonic() - start)


def _check(case: Case, result: Result) -> None:
    print(f"{case.id} --smoke: exit {result.code} after {result.seconds:.1f} s")
    report = f"exit {result.code} after {result.seconds:.1f} s\n--- stdout\n{result.out[-4000:]}\n--- stderr\n" \
             f"{result.err[-4000:]}"
    assert result.code == 0, report
    lines = result.out.splitlines()
    for pattern in case.lines:
        assert any(re.fullmatch(pattern, line.strip()) for line in lines), f"no line matches {pattern!r}\n{report}"


def _stop(proc: subprocess.Popen[str]) -> None:
    for sig, wait_s in ((signal.SIGINT, 15), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


@pytest.fixture(scope="module")
def runs(request: pytest.FixtureRequest) -> Iterator[Runs]:
    """The runs of the selected cases only (``-k topology`` starts one benchmark, not all of them)."""
    selected = {item.callspec.params["case"] for item in request.session.items
                if item.module is request.module and hasattr(item, "callspec")}
    started = Runs([case for case in CASES if case in selected])
    yield started
    started.close()


@pytest.mark.parametrize("case", CASES, ids=[case.id for case in CASES])
def test_benchmark_smoke(case: Case, runs: Runs) -> None:
    _check(case, runs.result(case))


@pytest.mark.parametrize("case", SLURM_CASES, ids=[case.id for case in SLURM_CASES])
def test_benchmark_smoke_on_the_cluster(case: Case, slurm_cluster: object) -> None:
    """Asks for the cluster by name, so it runs in the Slurm lane, one at a time with the other cluster tests."""
    _check(case, _run_case(case))


def test_smoke_runs_leave_nothing_in_the_repository(runs: Runs) -> None:
    for future in runs.futures.values():
        future.exception()  # wait for every run, whatever its outcome
    left = _untracked() - runs.before
    assert not left, f"left in the repository by the smoke runs (untracked in git status): {sorted(left)}"
