"""Lightning, Hugging Face Trainer and accelerate scripts preempted on the local Slurm cluster and followed as users
run them: what a preemption costs with and without hpc_train's integration, against an uninterrupted torchrun.

    .venv/bin/python benchmarks/library_preemption.py [--libs lightning,hf_trainer,accelerate] [--plain-libs ...]
                                                      [--integrated-libs ...] [--json] [--smoke]

For each library the example script (``examples/LIB/train.py``) runs three ways: under ``torchrun`` on this
machine, uninterrupted (the baseline: 2 processes); and through ``python -m hpc_train.submit`` on 2 Slurm nodes x 1
rank, followed (no ``--no-follow``), once alone (``--plain``: the script knows nothing of hpc_train; it checkpoints
every 20 steps and resumes from its own last checkpoint) and once with the integration. Each Slurm run gets
``scancel --signal=USR2`` once: the plain one at a random step after its first checkpoint, the integrated one at
a random step before it (5-18, across the first epoch's end at step 16). Reported per run: the submit command's
exit status, the signal to the next attempt's first step (seconds), the steps trained twice (the last step
trained before the stop minus the step resumed from), whether the final weights are bitwise equal to torchrun's,
and whether ``logs --errors-only`` shows a failure. Targets:
exit 0, bitwise equal, no failure; with the integration 0 steps trained twice. All Slurm runs go at once (each
asks for 1 CPU on each of the 2 nodes), with the three torchrun baselines starting beside them, so the figures
include their contention on this 2-core machine.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PYTHON = sys.executable
LIBS = ("lightning", "hf_trainer", "accelerate")
JOB_NAMES = {"lightning": "lightning-mlp", "hf_trainer": "hf-trainer-mlp", "accelerate": "accelerate-mlp"}
STEPS, SMOKE_STEPS = 100, 60
STEP_SLEEP_S = 0.25
# The runs requeue and never restart inside the job: no standby ranks (each node's agent would import a library's
# stack again 10 s into every life, for a restart that does not come, on the same 2 cores)
TWO_NODES = ["--site", "local-slurm", "--set", "job.nodes=2", "--set", "job.tasks_per_node=1", "--set",
             "job.cpus_per_task=1", "--set", "retry.standby=false"]
# A rank's variables from the calling process would mislead torchrun's workers (LOCAL_SIZE above all)
_RANK_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                   "GROUP_RANK", "ROLE_RANK", "ROLE_WORLD_SIZE")
ENV = {**{k: v for k, v in os.environ.items() if k not in _RANK_VARIABLES}, "OMP_NUM_THREADS": "1",
       "PYTHONUNBUFFERED": "1"}


@dataclass
class Run:
    """One Slurm run of one library's script, and what it showed."""

    lib: str
    integration: bool
    signal_at: int  # the step after which USR2 is sent (a plain script: after its first checkpoint)
    work: Path
    exit_code: int | None = None
    signalled: float | None = None
    stopped_after: int | None = None  # the last step trained before the stop
    resumed_from: int | None = None  # the step the next attempt continued from
    restart_s: float | None = None  # USR2 to the next attempt's first step
    bitwise: bool | None = None
    failures: list[str] = field(default_factory=list)  # logs --errors-only: errors (not warnings)
    outcomes: list[str] = field(default_factory=list)  # attempts.jsonl
    metric_steps: list[int] = field(default_factory=list)  # metrics.jsonl (integration)
    output: str = ""

    @property
    def name(self) -> str:
        return f"{self.lib}{' + integration' if self.integration else ' (plain)'}"

    @property
    def run_dir(self) -> Path:
        return self.work / "runs" / JOB_NAMES[self.lib]

    @property
    def twice(self) -> int | None:
        if self.stopped_after is None or self.resumed_from is None:
            return None
        return max(0, self.stopped_after - self.resumed_from)


def script_args(lib: str, folder: Path, steps: int, out: Path, step_log: Path | None = None) -> list[str]:
    """The example's arguments: steps, where its checkpoints and final weights go, a slower step."""
    where = {"lightning": "--checkpoints", "hf_trainer": "--output-dir", "accelerate": "--checkpoints"}[lib]
    args = ["--steps", str(steps), where, str(folder), "--out", str(out), "--step-sleep", str(STEP_SLEEP_S)]
    return args + (["--step-log", str(step_log)] if step_log else [])


def torchrun_weights(lib: str, work: Path, steps: int) -> Path:
    """The uninterrupted baseline: the plain script under torchrun, 2 processes on this machine (``--standalone``:
    a port nothing else holds, so several runs, or test lanes, can start at once)."""
    out = work / f"{lib}-torchrun.pt"
    args = script_args(lib, work / f"{lib}-torchrun-checkpoints", steps, out)
    args[args.index("--step-sleep") + 1] = "0"
    for _attempt in range(2):  # once more when a worker died by a signal (a gloo abort seen under load), not a code
        shutil.rmtree(work / f"{lib}-torchrun-checkpoints", ignore_errors=True)  # a fresh start, not a resume
        result = subprocess.run([PYTHON, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                                 str(REPO / "examples" / lib / "train.py"), *args, "--plain"], cwd=work, env=ENV,
                                capture_output=True, text=True, timeout=600, check=False)
        if "exitcode  : -" not in result.stderr:
            break
    if result.returncode != 0:
        raise RuntimeError(f"torchrun {lib} failed:\n{result.stdout[-2000:]}\n{result.stderr[-3000:]}")
    return out


def _steps(path: Path) -> list[tuple[int, float]]:
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError:
        return []
    return [(int(step), float(when)) for step, when in (line.split() for line in lines if len(line.split()) == 2)]


def _job_id(run: Run) -> str | None:
    path = run.run_dir / "attempts.jsonl"
    try:
        return json.loads(path.read_text(encoding="utf-8").splitlines()[0])["job_id"]
    except (OSError, ValueError, IndexError, KeyError):
        return None


def _signal_when_due(run: Run, process: subprocess.Popen[str], step_log: Path) -> None:
    deadline = time.monotonic() + 420
    while process.poll() is None and time.monotonic() < deadline:
        trained = _steps(step_log)
        job = _job_id(run)
        if job and trained and trained[-1][0] >= run.signal_at:
            run.signalled = time.time()
            subprocess.run(["scancel", "--signal=USR2", job], check=False, timeout=30)
            return
        time.sleep(0.05)


def slurm_run(run: Run, steps: int, reference: Future[Path]) -> Run:
    """Submit and follow one run, signal it once, then read what it left. The uninterrupted baseline
    (``reference``) is awaited only for the comparison: the Slurm runs do not queue behind the torchruns."""
    import torch  # only here: the report needs no torch

    run.work.mkdir(parents=True, exist_ok=True)
    step_log, out = run.work / "steps.txt", run.work / "weights.pt"
    folder = run.run_dir / ("hf-output" if run.lib == "hf_trainer" else "checkpoints")
    args = script_args(run.lib, folder, steps, out, step_log) + ([] if run.integration else ["--plain"])
    process = subprocess.Popen([PYTHON, "-m", "hpc_train.submit", str(REPO / "examples" / run.lib / "job.toml"),
                                *TWO_NODES, "--set", f"job.args={json.dumps(args)}"], cwd=run.work, env=ENV,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    signaller = threading.Thread(target=_signal_when_due, args=(run, process, step_log), daemon=True)
    signaller.start()
    try:
        run.output, _ = process.communicate(timeout=600)
    except subprocess.TimeoutExpired:
        process.kill()
        run.output, _ = process.communicate()
    run.exit_code = process.returncode
    signaller.join(timeout=5)
    _read_outcome(run, step_log)
    try:
        baseline = reference.result()
    except Exception as error:  # this run cannot be compared: it says why, and the other runs still report
        run.failures.append(f"the torchrun baseline failed: {str(error)[-1000:]}")
        return run
    if out.exists():
        ours, theirs = torch.load(out, weights_only=True), torch.load(baseline, weights_only=True)
        run.bitwise = ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in theirs)
    return run


def _read_outcome(run: Run, step_log: Path) -> None:
    trained = _steps(step_log)  # rank 0's (step, time) of every attempt, in order
    attempts_path = run.run_dir / "attempts.jsonl"
    attempts = [json.loads(line) for line in attempts_path.read_text().splitlines()] if attempts_path.exists() else []
    run.outcomes = [a["outcome"] for a in attempts]
    if run.signalled is not None and len(attempts) > 1:
        restarted = attempts[1]["started"]  # the next attempt's rank 0 opened its record before any step
        before = [step for step, when in trained if when < restarted]
        after = [(step, when) for step, when in trained if when >= restarted]
        if before and after:
            run.stopped_after, run.resumed_from = max(before), after[0][0] - 1
            run.restart_s = after[0][1] - run.signalled
    metrics = run.run_dir / "metrics.jsonl"
    if metrics.exists():
        run.metric_steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
    logs = subprocess.run([PYTHON, "-m", "hpc_train", "logs", str(run.run_dir), "--errors-only", "--json"],
                          capture_output=True, text=True, timeout=120, check=False)
    try:
        view = json.loads(logs.stdout)
        run.failures = [e.get("error", "") for e in view.get("errors", [])] + [
            r.get("text", "")[:200] for r in view.get("error_records", []) if r.get("severity") == "error"]
    except ValueError:
        run.failures = [f"logs --errors-only failed: {logs.stderr.strip()[-300:]}"]


def report(runs: list[Run]) -> str:
    lines = [f"{'run':<28} {'exit':>4} {'USR2 to next step s':>20} {'steps twice':>11} {'bitwise':>7}  failures",
             "-" * 90]
    for run in runs:
        restart = f"{run.restart_s:.1f}" if run.restart_s is not None else "-"
        twice = str(run.twice) if run.twice is not None else "-"
        lines.append(f"{run.name:<28} {run.exit_code!s:>4} {restart:>20} {twice:>11} {run.bitwise!s:>7}  "
                     f"{len(run.failures)}")
    for lib in dict.fromkeys(run.lib for run in runs):
        pair = {run.integration: run for run in runs if run.lib == lib}
        if True in pair and False in pair and pair[True].restart_s and pair[False].restart_s:
            lines.append(f"{lib}: with the integration / without: USR2 to next step "
                         f"{pair[True].restart_s / pair[False].restart_s:.2f}x; steps trained twice "
                         f"{pair[True].twice} against {pair[False].twice}")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--libs", default=",".join(LIBS))
    parser.add_argument("--plain-libs", default=None, help="of --libs, those that run without the integration "
                        "(default: all of them)")
    parser.add_argument("--integrated-libs", default=None, help="of --libs, those that run with the integration "
                        "(default: all of them)")
    parser.add_argument("--seed", type=int, default=None, help="the random signal steps (default: a new seed)")
    parser.add_argument("--json", action="store_true", help="one JSON line per run after the report")
    parser.add_argument("--smoke", action="store_true", help=f"Lightning only, {SMOKE_STEPS} steps")
    args = parser.parse_args()
    libs = ["lightning"] if args.smoke else [lib for lib in args.libs.split(",") if lib]
    plain = libs if args.plain_libs is None else [lib for lib in args.plain_libs.split(",") if lib]
    integrated = libs if args.integrated_libs is None else [lib for lib in args.integrated_libs.split(",") if lib]
    for option, chosen, allowed in (("--libs", libs, LIBS), ("--plain-libs", plain, libs),
                                    ("--integrated-libs", integrated, libs)):
        unknown = [lib for lib in chosen if lib not in allowed]
        if unknown:
            print(f"error: {option} {','.join(unknown)}: pick from {', '.join(allowed)}", file=sys.stderr)
            return 2
    steps = SMOKE_STEPS if args.smoke else STEPS
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1 << 30)
    pick = random.Random(seed)  # noqa: S311 - not a secret
    with tempfile.TemporaryDirectory(prefix="hpc_train-libpreempt-") as tmp:
        work = Path(tmp)
        # integrated runs are signalled before the scripts' first own checkpoint (step 20), across the first
        # epoch's end (step 16): what they resume from is then their stop's save alone
        runs = [Run(lib, integration, pick.randint(5, 18) if integration else pick.randint(22, 34),
                    work / f"{lib}-{'with' if integration else 'plain'}")
                for lib in libs for integration in (False, True) if lib in (integrated if integration else plain)]
        with ThreadPoolExecutor(max_workers=len(runs) + len(libs)) as pool:
            references = {lib: pool.submit(torchrun_weights, lib, work, steps) for lib in {run.lib for run in runs}}
            finished = list(pool.map(lambda run: slurm_run(run, steps, references[run.lib]), runs))
        print(f"seed {seed}; {steps} steps of {STEP_SLEEP_S} s; 2 Slurm nodes x 1 rank, all runs at once")
        print(report(finished))
        if args.json:
            for run in finished:
                record = {k: v for k, v in asdict(run).items() if k not in ("work", "output")}
                print(json.dumps({**record, "name": run.name, "twice": run.twice,
                                  "output_tail": run.output[-4000:] if run.exit_code else ""}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
