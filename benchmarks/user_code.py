"""Your own code under hpc_train, against the same loop under plain torchrun and under submitit's Checkpointable.

    .venv/bin/python benchmarks/user_code.py [--runs N] [--slurm] [--only first|overhead|slurm] [--smoke]

The user code is ``benchmarks/user_code_loop.py``: an MLP (16 -> hidden -> hidden -> 1, ``--hidden``) trained with
DDP over gloo, one thread per rank, the same batches in every form. Three figures, each against baselines
measured in the same run (runs alternate, the order turned by one each run):

(a) Submit to the first step, 2 ranks on this machine. The clock starts before the command a user types and
    stops at rank 0's record of step 1: ``python -m hpc_train.submit job.toml --site local`` running
    ``user_code_loop.py:loop`` (following the job, as users run it; its ``metrics.jsonl`` line of step 1), against
    ``torchrun --nproc_per_node=2 user_code_loop.py`` (a plain script with ``init_process_group("gloo")``) and a
    fresh ``python`` that submits a ``submitit.helpers.Checkpointable`` of the loop to submitit's
    ``LocalExecutor`` (2 tasks, torch.distributed from submitit's ``TorchDistributedEnvironment``) and waits for
    it; both write a timestamped line after step 1. "code entered" is when rank 0 starts the user's code (after
    ``import torch``; under hpc_train also after the bootstrap, which runs before the function is called).
    Ratios: x torchrun and x submitit.
(b) The per-step cost of ``ctx.should_stop()`` (and of ``ctx.log`` with it), under hpc_train: one job of 2 ranks
    runs the same step plain, with ``ctx.should_stop()`` after it, and with ``ctx.log(step, loss=...)`` and
    ``ctx.should_stop()``, and, for reference, with a bare ``dist.all_reduce(async_op=True)`` of one scalar
    waited for a step later (the least any collective stop flag costs), in blocks of ``--block`` steps, every
    variant once a round (``--rounds``, the order turned each round, after ``--warmup`` untimed steps of each),
    timed inside the ranks (the slower rank's time per block). s/step: the median over blocks; ratio: the median
    over rounds of the block's time against the same round's plain block; us per step: the difference of the
    medians. Target: should_stop <= 1.01 of the plain loop.
(c) ``--slurm``, on the local Slurm cluster (``scripts/local_slurm.sh up``; 2 nodes x 1 rank): the loop checks
    ``ctx.should_stop()`` every step (``--step-sleep`` after each) and saves with ``ctx.checkpoint.save`` when it
    says stop; once step ``--at`` is logged, ``scancel --signal=USR2 JOBID``, timed to the first step of the next
    attempt (its first ``metrics.jsonl`` record). Side by side: submitit's AutoExecutor (Slurm) running the same
    loop as a Checkpointable whose ``checkpoint()`` saves its state with ``torch.save`` on rank 0 (submitit calls
    it there, in its signal handler) and returns a ``DelayedSubmission``. Also, in seconds after the signal: when
    the state was saved, when Slurm started the job again (sacct, whole seconds), when the next attempt's code
    started (after ``import torch``; under hpc_train after the bootstrap too). Steps lost = the last step logged
    before the signal minus the step the next attempt resumed from (0 or less: nothing to redo). Each run waits
    for an empty queue. Targets: hpc_train <= 16 s (submitit measured 25 s here before), 0 steps lost. Skipped,
    saying why, without sbatch on PATH or without an answering slurmctld.

(a) starts with one untimed torchrun run (page cache). Every command's output goes to ``command.log`` in its run
folder; ``--keep`` keeps the folders (a failed run always does, and says where).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import submitit

from hpc_train.run.watch import last_logged_step

BENCH = Path(__file__).resolve().parent
LOOP = BENCH / "user_code_loop.py"
# Variables a rank reads for its place: one left over in this shell would leak into submitit's jobs.
_RANK_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                   "GROUP_RANK", "TORCHELASTIC_RUN_ID")
OVERHEAD_VARIANTS = ["plain", "should_stop", "should_stop+log", "async_all_reduce"]
# --smoke: these arguments (the rest keep their defaults; (c) still needs steps after the signal to stop at)
SMOKE = {"runs": 1, "hidden": 16, "rounds": 1, "block": 2, "warmup": 1, "at": 2, "after": 20}


class SubmititLoop(submitit.helpers.Checkpointable):
    """The loop as submitit's users requeue it: rank 0's ``checkpoint()`` saves, then resubmits a fresh copy."""

    def __init__(self, config: dict[str, Any]) -> None:
        self.config = config
        self._run: Any = None

    def __call__(self) -> int:
        import user_code_loop  # on the rank: torch

        self._run = user_code_loop.run_submitit(self.config)
        return self._run.run()

    def checkpoint(self, *args: Any, **kwargs: Any) -> submitit.helpers.DelayedSubmission:
        if self._run is not None:
            self._run.save()
        return submitit.helpers.DelayedSubmission(SubmititLoop(self.config))


# --- helpers ------------------------------------------------------------------------------------------------

def _env(**extra: str) -> dict[str, str]:
    env = {name: value for name, value in os.environ.items() if name not in _RANK_VARIABLES}
    env.update(extra)
    return env


def _jsonl(path: Path) -> list[dict[str, Any]]:
    """Every complete JSON line of ``path`` (a line still being written is skipped)."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError:
        return []
    records = []
    for line in lines:
        try:
            records.append(json.loads(line))
        except ValueError:
            continue
    return records


def _wait(what: str, ready: Callable[[], bool], process: subprocess.Popen | None, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        if process is not None and process.poll() is not None and not ready():
            raise RuntimeError(f"the command ended (exit {process.returncode}) before {what}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {what} after {timeout:.0f} s")
        time.sleep(0.01)


# What gloo's threads print when a rank process is torn down while a peer's connection closes under them: once
# in about a hundred runs of the plain torchrun baseline on this 2-core machine, after its last step and its
# barrier and destroy_process_group (CI, 2026-12-06). The baseline's figure (its first step) is already taken.
GLOO_TEARDOWN_ABORT = "terminate called without an active exception"
TEARDOWN_ABORTS: list[str] = []  # the baseline runs that ended so, said under the table


def _finish(process: subprocess.Popen, what: str, folder: Path, timeout: float = 600, steps: int = 0) -> None:
    """Wait for ``what``; RuntimeError with its log's last lines unless it exited 0. With ``steps`` (a plain
    baseline: torchrun, submitit), an abort in gloo's teardown after its last step is counted, not fatal."""
    try:
        code = process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        raise RuntimeError(f"{what} did not end within {timeout:.0f} s; see {folder}") from None
    if code == 0:
        return
    log = (folder / "command.log").read_text(encoding="utf-8", errors="replace")
    if steps and GLOO_TEARDOWN_ABORT in log and _last_step(folder) == steps:
        TEARDOWN_ABORTS.append(f"{what} in {folder.name}")
        return
    tail = "\n".join(log.splitlines()[-25:])
    raise RuntimeError(f"{what} exited {code}; see {folder}; its log ends:\n{tail}")


def _last_step(folder: Path) -> int | None:
    """The last step rank 0's events file records, None without one."""
    steps = [r["step"] for r in _jsonl(folder / "events.jsonl") if r.get("event") == "step"]
    return steps[-1] if steps else None


def _start(command: list[str], folder: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    """``command`` in ``folder``, its output into ``command.log`` there (kept with --keep, or when a run fails)."""
    with (folder / "command.log").open("a") as log:
        return subprocess.Popen(command, cwd=folder, env=env or _env(), stdout=log, stderr=subprocess.STDOUT)


def _toml(value: Any) -> str:
    if isinstance(value, list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    if isinstance(value, bool):
        return "true" if value else "false"
    return json.dumps(value)  # strings and numbers: JSON spells them as TOML does


def _job_toml(name: str, function: str, nodes: int, tasks_per_node: int, params: dict[str, Any]) -> str:
    lines = ["[job]", f"name = {_toml(name)}", f"program = {_toml(f'{LOOP}:{function}')}", f"nodes = {nodes}",
             f"tasks_per_node = {tasks_per_node}", 'time = "00:10:00"', "", "[params]"]
    lines += [f"{key} = {_toml(value)}" for key, value in params.items()]
    return "\n".join(lines) + "\n"


def _submitit_command(kind: str, config: dict[str, Any]) -> list[str]:
    """A fresh interpreter that submits the Checkpointable as a submitit user's script does, and waits for it."""
    return [sys.executable, str(Path(__file__).resolve()), "--submitit-submit", kind, json.dumps(config)]


def _submitit_submit(kind: str, config: dict[str, Any]) -> int:
    """The submitting side of the submitit baselines (run in its own interpreter by the driver)."""
    import user_code  # this file by its module name, so the job unpickles SubmititLoop from it (PYTHONPATH)

    folder = Path(config["folder"]) / "submitit"
    if kind == "local":
        executor: Any = submitit.LocalExecutor(folder=folder)
        executor.update_parameters(nodes=1, tasks_per_node=2, timeout_min=10)
    else:
        executor = submitit.AutoExecutor(folder=folder, cluster="slurm")
        executor.update_parameters(nodes=2, tasks_per_node=1, cpus_per_task=config.get("cpus_per_task", 1),
                                   timeout_min=10, slurm_partition="batch", name="user-code-submitit")
    job = executor.submit(user_code.SubmititLoop(config))
    (Path(config["folder"]) / "job_id").write_text(str(job.job_id), encoding="utf-8")
    job.results()
    return 0


def _median_range(values: list[float]) -> str:
    return f"{statistics.median(values):6.2f} ({min(values):.2f}-{max(values):.2f})"


# --- (a) submit to the first step ---------------------------------------------------------------------------

def _first_hpc_train(folder: Path, steps: int, hidden: int) -> dict[str, float]:
    events = folder / "events.jsonl"
    (folder / "job.toml").write_text(_job_toml("first", "loop", 1, 2, {"steps": steps, "hidden": hidden,
                                                                       "events": str(events)}))
    start = time.time()
    process = _start([sys.executable, "-m", "hpc_train.submit", "job.toml", "--site", "local"], folder)
    _finish(process, "hpc_train.submit", folder)
    first = next(r for r in _jsonl(folder / "runs" / "first" / "metrics.jsonl") if r.get("step") == 1)
    entered = next(r for r in _jsonl(events) if r["event"] == "enter")
    return {"entered": entered["time"] - start, "first": first["time"] - start}


def _events_first(folder: Path, start: float) -> dict[str, float]:
    records = _jsonl(folder / "events.jsonl")
    entered = next(r for r in records if r["event"] == "enter")
    first = next(r for r in records if r["event"] == "step" and r["step"] == 1)
    return {"entered": entered["time"] - start, "first": first["time"] - start}


def _first_torchrun(folder: Path, steps: int, hidden: int) -> dict[str, float]:
    torchrun = Path(sys.executable).parent / "torchrun"
    launcher = [str(torchrun)] if torchrun.exists() else [sys.executable, "-m", "torch.distributed.run"]
    command = [*launcher, "--nproc_per_node=2", "--standalone", str(LOOP),
               str(folder / "events.jsonl"), str(steps), str(hidden)]
    start = time.time()
    process = _start(command, folder)
    _finish(process, "torchrun", folder, steps=steps)
    return _events_first(folder, start)


def _first_submitit(folder: Path, steps: int, hidden: int) -> dict[str, float]:
    config = {"folder": str(folder), "events": str(folder / "events.jsonl"), "steps": steps, "hidden": hidden}
    start = time.time()
    process = _start(_submitit_command("local", config), folder, _env(PYTHONPATH=str(BENCH)))
    _finish(process, "the submitit LocalExecutor submission", folder, steps=steps)
    return _events_first(folder, start)


FIRST_PATHS: dict[str, Callable[[Path, int, int], dict[str, float]]] = {
    "hpc_train.submit (local executor)": _first_hpc_train,
    "torchrun --nproc_per_node=2": _first_torchrun,
    "submitit LocalExecutor, Checkpointable": _first_submitit,
}


def measure_first(work: Path, runs: int, hidden: int, warmups: int = 1) -> None:
    steps = 5
    for index in range(warmups):
        _first_torchrun(_fresh(work, f"warmup-{index}"), steps, hidden)  # page cache: torch, the venv
    results: dict[str, list[dict[str, float]]] = {name: [] for name in FIRST_PATHS}
    names = list(FIRST_PATHS)
    for index in range(runs):
        shift = index % len(names)
        for name in names[shift:] + names[:shift]:
            result = FIRST_PATHS[name](_fresh(work, f"first-{index}-{names.index(name)}"), steps, hidden)
            results[name].append(result)
    torchrun, sub = (statistics.median(r["first"] for r in results[n]) for n in names[1:])
    print(f"(a) submit to the first step: {runs} runs, 2 ranks on this machine, hidden {hidden}; "
          "median (min-max) seconds from the command")
    print(f"{'path':40} {'code entered':>20} {'first step':>20} {'x torchrun':>10} {'x submitit':>10}")
    for name in names:
        entered = [r["entered"] for r in results[name]]
        first = [r["first"] for r in results[name]]
        median = statistics.median(first)
        print(f"{name:40} {_median_range(entered):>20} {_median_range(first):>20} {median / torchrun:10.2f} "
              f"{median / sub:10.2f}")
    if TEARDOWN_ABORTS:
        print(f"aborted in gloo's teardown after their last step (measured all the same): {', '.join(TEARDOWN_ABORTS)}")
    print()


# --- (b) the per-step cost of should_stop() -----------------------------------------------------------------

def measure_overhead(work: Path, runs: int, args: argparse.Namespace) -> None:
    blocks: list[dict[str, Any]] = []
    for index in range(runs):
        folder = _fresh(work, f"overhead-{index}")
        out = folder / "overhead.json"
        params = {"variants": OVERHEAD_VARIANTS, "rounds": args.rounds, "block": args.block, "warmup": args.warmup,
                  "hidden": args.hidden, "out": str(out)}
        (folder / "job.toml").write_text(_job_toml("overhead", "overhead", 1, 2, params))
        process = _start([sys.executable, "-m", "hpc_train.submit", "job.toml", "--site", "local"], folder)
        _finish(process, "hpc_train.submit (overhead)", folder, timeout=1800)
        blocks += [dict(block, run=index) for block in json.loads(out.read_text())["blocks"]]
    per_step = {v: [b["seconds"] / b["steps"] for b in blocks if b["variant"] == v] for v in OVERHEAD_VARIANTS}
    rounds: dict[tuple[int, int], dict[str, float]] = {}
    for block in blocks:
        rounds.setdefault((block["run"], block["round"]), {})[block["variant"]] = block["seconds"] / block["steps"]
    plain = statistics.median(per_step["plain"])
    print(f"(b) per-step cost under hpc_train: {runs} run(s) x {args.rounds} rounds x {args.block} steps per "
          f"variant, 2 ranks, DDP over gloo, hidden {args.hidden}")
    print(f"{'variant':24} {'s/step':>9} {'min-max':>17} {'ratio':>7} {'us per step':>12}")
    for variant in OVERHEAD_VARIANTS:
        values = per_step[variant]
        ratio = statistics.median(r[variant] / r["plain"] for r in rounds.values())
        extra = (statistics.median(values) - plain) * 1e6
        print(f"{variant:24} {statistics.median(values):9.5f} {min(values):8.5f}-{max(values):.5f} {ratio:7.3f} "
              f"{extra:12.1f}")
    ratio = statistics.median(r["should_stop"] / r["plain"] for r in rounds.values())
    print(f"should_stop() against the plain loop: {ratio:.3f} (target 1.01: {'met' if ratio <= 1.01 else 'NOT met'})")
    print()


# --- (c) preemption on the local Slurm cluster --------------------------------------------------------------

def _idle(timeout: float = 600) -> None:
    """Wait until no job is queued, so every run starts on an idle cluster."""
    deadline = time.monotonic() + timeout
    while subprocess.run(["squeue", "-h"], capture_output=True, text=True, check=True).stdout.strip():
        if time.monotonic() > deadline:
            raise TimeoutError(f"the Slurm queue was not empty for {timeout:.0f} s (squeue)")
        time.sleep(0.5)
    time.sleep(0.5)


def _scancel_usr2(job_id: str) -> float:
    sent = time.time()
    subprocess.run(["scancel", "--signal=USR2", job_id], check=True, capture_output=True)
    return sent


def _cancel(job_id: str) -> None:
    """A run that failed leaves no job behind."""
    if job_id:
        subprocess.run(["scancel", job_id], capture_output=True)


def _restarted(job_id: str) -> float:
    """When Slurm started the job's second run (sacct: whole seconds, this machine's clock); nan if it never says."""
    for _ in range(50):  # slurmdbd writes a moment after the job ended
        starts = subprocess.run(["sacct", "--duplicates", "-X", "-n", "-P", "-o", "Start", "-j", job_id],
                                capture_output=True, text=True).stdout.split()
        if len(starts) >= 2 and starts[1][:1].isdigit():
            return time.mktime(time.strptime(starts[1], "%Y-%m-%dT%H:%M:%S"))
        time.sleep(0.2)
    return float("nan")


def _signalled(process: subprocess.Popen[str], job_id: Callable[[], str | None], last_step: Callable[[], int],
               at: int, label: str, folder: Path) -> tuple[str, int, float]:
    """Wait for the job id and step ``at``, send USR2, follow the run to its end (cancelling the job if anything
    fails); return (job id, the last step logged at the signal, when it was sent)."""
    found = ""
    try:
        _wait("the job id", lambda: job_id() is not None, process)
        found = job_id() or ""
        _wait(f"step {at}", lambda: last_step() >= at, process)
        at_signal = last_step()
        sent = _scancel_usr2(found)
        _finish(process, label, folder)
    except BaseException:
        _cancel(found)
        raise
    finally:
        if process.poll() is None:
            process.kill()
    return found, at_signal, sent


def _preempt_hpc_train(folder: Path, args: argparse.Namespace) -> dict[str, Any]:
    events = folder / "events.jsonl"
    params = {"steps": args.at + args.after, "hidden": args.hidden, "step_sleep": args.step_sleep,
              "events": str(events)}
    (folder / "job.toml").write_text(_job_toml("preempt", "loop", 2, 1, params))
    run_dir = folder / "runs" / "preempt"
    process = subprocess.Popen([sys.executable, "-m", "hpc_train.submit", "job.toml", "--site", "local-slurm"],
                               cwd=folder, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    output: list[str] = []
    reader = threading.Thread(target=lambda: output.extend(process.stdout), daemon=True)  # type: ignore[arg-type]
    reader.start()

    def submitted() -> str | None:
        return next((m.group(1) for line in output if (m := re.search(r"submitted job (\d+)", line))), None)

    try:
        job_id, at_signal, sent = _signalled(process, submitted, lambda: last_logged_step(run_dir), args.at,
                                             "hpc_train.submit (Slurm)", folder)
    finally:
        reader.join(timeout=5)
    (folder / "submit.out").write_text("".join(output))
    attempts = _jsonl(run_dir / "attempts.jsonl")
    if len(attempts) < 2:
        raise RuntimeError(f"hpc_train recorded {len(attempts)} attempt(s), expected 2; see {folder}")
    ended = attempts[0]["ended"]
    first = min(r["time"] for r in _jsonl(run_dir / "metrics.jsonl") if r["time"] > ended)
    entered = [r["time"] for r in _jsonl(events) if r["event"] == "enter"]
    return {"at": at_signal, "saved_step": attempts[0]["end_step"], "resumed": attempts[1]["start_step"],
            "saved": ended - sent, "entered": entered[1] - sent if len(entered) > 1 else float("nan"),
            "first": first - sent, "completed": attempts[-1]["outcome"] == "completed", "job_id": job_id,
            "restarted": _restarted(job_id) - sent}


def _preempt_submitit(folder: Path, args: argparse.Namespace) -> dict[str, Any]:
    events = folder / "events.jsonl"
    steps = args.at + args.after
    config = {"folder": str(folder), "events": str(events), "steps": steps, "hidden": args.hidden,
              "step_sleep": args.step_sleep, "cpus_per_task": args.cpus_per_task}
    process = _start(_submitit_command("slurm", config), folder, _env(PYTHONPATH=str(BENCH)))

    def last_step() -> int:
        return max((r["step"] for r in _jsonl(events) if r["event"] == "step"), default=0)

    def submitted() -> str | None:
        path = folder / "job_id"
        return path.read_text().strip() if path.exists() else None

    job_id, at_signal, sent = _signalled(process, submitted, last_step, args.at, "the submitit Slurm submission",
                                         folder)
    records = _jsonl(events)
    saved = next(r for r in records if r["event"] == "saved")
    resumed = next(r for r in records if r["event"] == "resumed")
    entered = [r["time"] for r in records if r["event"] == "enter"]
    first = next(r for r in records if r["event"] == "step" and r["attempt"] == resumed["attempt"])
    return {"at": at_signal, "saved_step": saved["step"], "resumed": resumed["step"], "saved": saved["time"] - sent,
            "entered": entered[1] - sent if len(entered) > 1 else float("nan"), "first": first["time"] - sent,
            "completed": last_step() == steps, "job_id": job_id, "restarted": _restarted(job_id) - sent}


PREEMPT_PATHS: dict[str, Callable[[Path, argparse.Namespace], dict[str, Any]]] = {
    "hpc_train.submit (Slurm)": _preempt_hpc_train,
    "submitit Checkpointable (Slurm)": _preempt_submitit,
}


def _slurm_missing() -> str | None:
    if shutil.which("sbatch") is None:
        return "sbatch is not on PATH"
    ping = subprocess.run(["scontrol", "ping"], capture_output=True, text=True)
    if ping.returncode != 0 or "UP" not in ping.stdout:
        return f"slurmctld does not answer (scontrol ping: {(ping.stdout + ping.stderr).strip() or ping.returncode})"
    return None


def measure_preemption(work: Path, runs: int, args: argparse.Namespace) -> None:
    missing = _slurm_missing()
    if missing:
        print(f"(c) skipped: {missing}; bring up the local cluster with scripts/local_slurm.sh up (as root)")
        return
    names = list(PREEMPT_PATHS)
    results: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    print(f"(c) scancel --signal=USR2 to the first step of the next attempt: local Slurm cluster, 2 nodes x 1 rank, "
          f"signal once step {args.at} is logged, {args.step_sleep} s sleep per step")
    for index in range(runs):
        for name in names if index % 2 == 0 else names[::-1]:
            _idle()
            result = PREEMPT_PATHS[name](_fresh(work, f"preempt-{index}-{names.index(name)}"), args)
            results[name].append(result)
            print(f"run {index + 1}, {name}: job {result['job_id']}, signal after step {result['at']}, saved step "
                  f"{result['saved_step']} at +{result['saved']:.2f} s, Slurm started the job again at "
                  f"+{result['restarted']:.0f} s (sacct), the next attempt's code at "
                  f"+{result['entered']:.2f} s, resumed at step {result['resumed']}, its first step at "
                  f"+{result['first']:.2f} s; completed: {result['completed']}")
    print(f"{'path':34} {'saved':>18} {'job restarted':>20} {'code entered':>20} {'first step':>20} {'ratio':>6} "
          f"{'steps lost':>10}")
    reference = statistics.median(r["first"] for r in results[names[1]])
    for name in names:
        rows = results[name]
        first = statistics.median(r["first"] for r in rows)
        lost = max(0, max(int(r["at"]) - int(r["resumed"]) for r in rows))
        cells = [_median_range([r[key] for r in rows]) for key in ("restarted", "entered", "first")]
        print(f"{name:34} {_median_range([r['saved'] for r in rows]):>18} {cells[0]:>20} {cells[1]:>20} "
              f"{cells[2]:>20} {first / reference:6.2f} {lost:>10}")
    hpc = statistics.median(r["first"] for r in results[names[0]])
    lost = max(0, max(int(r["at"]) - int(r["resumed"]) for r in results[names[0]]))
    print(f"hpc_train: {hpc:.1f} s to the next attempt's first step (target 16 s: {'met' if hpc <= 16 else 'NOT met'};"
          f" submitit here: {reference:.1f} s); steps lost {lost} (target 0: {'met' if lost == 0 else 'NOT met'})")


# --- main ---------------------------------------------------------------------------------------------------

def _fresh(work: Path, name: str) -> Path:
    folder = work / name
    folder.mkdir()
    return folder


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3, help="runs of each part (a, b, c)")
    parser.add_argument("--slurm", action="store_true", help="also (c), on the local Slurm cluster")
    parser.add_argument("--only", choices=["first", "overhead", "slurm"], help="run one part only")
    parser.add_argument("--hidden", type=int, default=256, help="the MLP's hidden width")
    parser.add_argument("--rounds", type=int, default=20, help="(b) rounds per run")
    parser.add_argument("--block", type=int, default=100, help="(b) steps per block")
    parser.add_argument("--warmup", type=int, default=100, help="(b) untimed steps of each variant first")
    parser.add_argument("--at", type=int, default=20, help="(c) the step after which the signal is sent")
    parser.add_argument("--after", type=int, default=40, help="(c) steps to train after --at")
    parser.add_argument("--step-sleep", type=float, default=0.05, help="(c) seconds of sleep after each step")
    parser.add_argument("--cpus-per-task", type=int, default=4, help="(c) submitit's cpus_per_task (hpc_train's "
                        "comes from the site: 4 for 1 task per node)")
    parser.add_argument("--keep", action="store_true", help="keep the run folders (printed at the end)")
    parser.add_argument("--smoke", action="store_true", help="one run of each part, tiny sizes, no warm-up run: "
                        "the benchmark runs end to end in seconds (CI), its figures mean nothing")
    parser.add_argument("--submitit-submit", nargs=2, metavar=("KIND", "CONFIG"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.smoke:
        for name, value in SMOKE.items():
            setattr(args, name, value)
    if args.submitit_submit:
        return _submitit_submit(args.submitit_submit[0], json.loads(args.submitit_submit[1]))
    parts = [args.only] if args.only else ["first", "overhead"] + (["slurm"] if args.slurm else [])
    work = Path(tempfile.mkdtemp(prefix="hpc_train-user-code-"))
    try:
        if "first" in parts:
            measure_first(work, args.runs, args.hidden, warmups=0 if args.smoke else 1)
        if "overhead" in parts:
            measure_overhead(work, args.runs, args)
        if "slurm" in parts:
            measure_preemption(work, args.runs, args)
    except BaseException:
        print(f"run folders kept in {work}", file=sys.stderr)
        raise
    if args.keep:
        print(f"run folders: {work}")
    else:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
