"""One prepared check of hpc_train's CUDA path on a machine with one GPU; a JSON report says what passed.

    scripts/gpu_check.sh [--cpu-dry-run] [--out benchmarks/results/gpu-check.json] [--only STEP,...]

The steps, each recorded whether it passes or not, so one run tells everything:

* ``environment``: torch, CUDA, the device as torch names it, bf16 support, DeepSpeed and submitit versions;
* ``trainer``: the built-in trainer through ``python -m hpc_train.submit`` (tiny in bf16, fp16 with dynamic
  loss scaling, ZeRO-3 with CPU offload and ``cpu_adam``, ``fused_adam``, the FSDP2 engine; then the 125M
  preset);
* ``resume``: a run preempted (USR2 to its rank) and resumed against the same run uninterrupted, bitwise;
* ``user_checkpoint``: a user function's ``ctx.checkpoint`` across a preemption;
* ``bench``: ``bench allreduce`` (on NCCL, the transport from NCCL's own log);
* ``hang``: an injected hang, the watchdog's stacks and (on NCCL) the flight recorder's dump;
* ``relife``: a warm restart's CUDA side in one process (``benchmarks/gpu_relife.py``): the NCCL group aborted,
  DeepSpeed's engine freed, the device memory given back, the context kept, the next life bitwise equal, the
  asynchronous save's staging pinned and let go of;
* ``mfu``: the 125M and 1.3B GPT through hpc_train (DeepSpeed, then FSDP2 in bf16, eager and with
  ``train.compile``) against the nanoGPT-style loop of the same model and batch (``benchmarks/gpu_baseline.py``),
  with and without ``torch.compile``.

``--cpu-dry-run`` runs the same steps on this CPU machine with gloo, fp32 and tiny sizes (2 ranks where ZeRO
needs data parallelism); steps that only exist on a GPU (fp16, fused_adam, the flight recorder) say so in the
report. CI runs it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
# H200 SXM: the same Hopper GH100 compute as H100 SXM (989 TFLOP/s dense bf16), more and faster memory.
H200_BF16_PEAK = 989e12


@dataclass
class Check:
    """Where the check runs and what it found so far."""

    work: Path
    dry: bool
    report: dict[str, Any] = field(default_factory=dict)
    trained: dict[str, dict[str, Any]] = field(default_factory=dict)  # runs by name, reused by later steps

    @property
    def site(self) -> str:
        return "local" if self.dry else str(self.work / "gpu-site.toml")

    @property
    def ranks(self) -> int:
        return 2 if self.dry else 1


class PartsFailedError(Exception):
    """A step that ran and found failures; its partial results go into the report."""

    def __init__(self, results: dict[str, Any]) -> None:
        super().__init__("some parts failed")
        self.results = results


def _gpu_site(work: Path) -> None:
    cpus = os.cpu_count() or 1
    (work / "gpu-site.toml").write_text(
        'name = "gpu-check"\ndescription = "one GPU, no Slurm"\n[slurm]\nenabled = false\n'
        f'[node]\ngpus = 1\ncpus = {cpus}\n[network]\ninterconnect = "tcp"\nsocket_ifname = "lo"\n'
        '[preempt]\nsignal = "USR2"\nlead_seconds = 60\n', encoding="utf-8")


def _job(check: Check, name: str, **sections: dict[str, Any]) -> Path:
    """A job file for ``name`` in the work folder: one GPU (or 2 CPU ranks in a dry run), no evaluation."""
    tables: dict[str, dict[str, Any]] = {
        "job": {"name": name, "nodes": 1, "tasks_per_node": check.ranks, "time": "00:30:00",
                "run_root": str(check.work / "runs"), **({} if check.dry else {"gpus_per_node": 1})},
        "train": {"model": "tiny", "steps": 20, "seq_len": 128, "micro_batch": 8, "lr": 1e-3, "warmup_steps": 2,
                  "precision": "fp32" if check.dry else "bf16"},
        "checkpoint": {"every_steps": 0, "keep": 2},
        "monitor": {"log_every": 2, "eval_every": 0},
    }
    for section, values in sections.items():
        tables.setdefault(section, {}).update(values)
    lines = []
    for section, values in tables.items():
        lines.append(f"[{section}]")
        lines += [f"{key} = {json.dumps(value)}" for key, value in values.items()]
    path = check.work / f"{name}.toml"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def _submit(check: Check, job: Path) -> subprocess.Popen[str]:
    """``python -m hpc_train.submit JOB`` on the local executor, as a user runs it."""
    return subprocess.Popen([sys.executable, "-m", "hpc_train.submit", str(job), "--site", check.site, "--executor",
                             "local"], cwd=check.work, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _finish(process: subprocess.Popen[str], what: str, timeout_s: float = 480) -> str:
    output, _ = process.communicate(timeout=timeout_s)
    if process.returncode != 0:
        raise RuntimeError(f"{what} exited {process.returncode}: {output[-1500:]}")
    return output


def _metrics(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.startswith("{")] if path.exists() else []


# The tiny run that the trainer, resume and (in a dry run) MFU steps share: 12 steps, a checkpoint at 6.
TINY = {"train": {"steps": 12}, "zero": {"stage": 2}, "checkpoint": {"every_steps": 6}, "monitor": {"log_every": 1}}


def _train(check: Check, name: str, **sections: dict[str, Any]) -> dict[str, Any]:
    """One run of the trainer: it must finish every step with a falling, finite loss. A run of that name that
    already passed is not run again."""
    if name in check.trained:
        return check.trained[name]
    job = _job(check, name, **sections)
    _finish(_submit(check, job), name)
    run_dir = check.work / "runs" / name
    result = json.loads((run_dir / "train.json").read_text())
    losses = [r["loss"] for r in _metrics(run_dir) if isinstance(r.get("loss"), float)]
    rates = [r["tokens_per_s"] for r in _metrics(run_dir) if r.get("tokens_per_s")]
    if not losses or not all(loss == loss for loss in losses) or losses[-1] >= losses[0]:
        raise RuntimeError(f"{name}: the loss did not fall: {losses}")
    check.trained[name] = {"precision": result.get("precision"), "steps": result.get("steps"),
                           "first_loss": losses[0], "final_loss": result.get("final_loss"),
                           "tokens_per_s": statistics.median(rates[1:] or rates),
                           "mfu": _metrics(run_dir)[-1].get("mfu")}
    return check.trained[name]


def step_environment(check: Check) -> dict[str, Any]:
    import deepspeed
    import submitit
    import torch

    cuda = torch.cuda.is_available()
    if not cuda and not check.dry:
        raise RuntimeError("no CUDA device: run with --cpu-dry-run on a machine without a GPU")
    info: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__,
                            "cuda": torch.version.cuda, "deepspeed": deepspeed.__version__,
                            "submitit": submitit.__version__, "device": "cpu"}
    if cuda:
        props = torch.cuda.get_device_properties(0)
        info.update(device=torch.cuda.get_device_name(0), capability=f"{props.major}.{props.minor}",
                    memory_gib=round(props.total_memory / 2**30, 1), bf16=torch.cuda.is_bf16_supported(),
                    nccl=".".join(map(str, torch.cuda.nccl.version())))
    return info


def step_trainer(check: Check) -> dict[str, Any]:
    variants: list[tuple[str, dict[str, Any], str]] = [
        ("tiny-zero2", TINY, ""),
        ("tiny-fp16-zero2", {"train": {"precision": "fp16"}, "zero": {"stage": 2}}, "fp16 needs a GPU"),
        ("tiny-zero3-offload-cpu-adam", {"train": {"optimizer": "cpu_adam"}, "zero": {
            "stage": 3, "offload_optimizer": True, "offload_params": True}},
         "compiling cpu_adam takes minutes on two cores"),
        ("tiny-fused-adam", {"train": {"optimizer": "fused_adam"}, "zero": {"stage": 2}}, "fused_adam needs CUDA"),
        ("tiny-fsdp2", {"train": {"engine": "fsdp2"}, "checkpoint": {"every_steps": 6}}, ""),
        ("125M-zero2", {"train": {"model": "125M", "seq_len": 1024, "micro_batch": 8}, "zero": {"stage": 2}},
         "the 125M preset is minutes per step on a CPU"),
    ]
    results: dict[str, Any] = {}
    for name, sections, dry_reason in variants:
        if check.dry and dry_reason:
            results[name] = {"status": "skipped", "why": dry_reason}
            continue
        try:
            results[name] = {"status": "passed", **_train(check, name, **sections)}
        except Exception as error:  # every variant is tried: the report says which ones fail
            results[name] = {"status": "failed", "error": str(error)[-1500:]}
    if any(r["status"] == "failed" for r in results.values()):
        raise PartsFailedError(results)
    return results


def _signal_at(run_dir: Path, step: int, process: subprocess.Popen[str], timeout_s: float = 300) -> None:
    """USR2 to local rank 0 once the run has logged ``step`` (the site's preemption signal)."""
    from hpc_train.run.watch import last_logged_step, local_rank_pid

    deadline = time.monotonic() + timeout_s
    while last_logged_step(run_dir) < step or local_rank_pid(run_dir, 0) is None:
        if process.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the run ended or stalled before step {step}")
        time.sleep(0.05)
    os.kill(local_rank_pid(run_dir, 0) or 0, signal.SIGUSR2)


def _attempts(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "attempts.jsonl").read_text().splitlines()]


def _exported(check: Check, run_dir: Path) -> dict[str, Any]:
    """``python -m hpc_train ckpt export RUN_DIR``, in this process (torch is imported here already)."""
    import torch

    from hpc_train.login.main import main as hpc_train_main

    out = check.work / f"{run_dir.name}.pt"
    if hpc_train_main(["ckpt", "export", str(run_dir), "--out", str(out)]) != 0:
        raise RuntimeError(f"ckpt export {run_dir} failed")
    return torch.load(out, map_location="cpu", weights_only=True)


def step_resume(check: Check) -> dict[str, Any]:
    """Preempted after step 4 and resumed on the local executor, against the same 12 steps uninterrupted."""
    import torch

    _train(check, "tiny-zero2", **TINY)  # the uninterrupted run (the trainer step's, when it ran)
    process = _submit(check, _job(check, "resume-cut", **TINY))
    cut = check.work / "runs" / "resume-cut"
    _signal_at(cut, 4, process)
    _finish(process, "the preempted run")
    attempts = _attempts(cut)
    if len(attempts) < 2 or attempts[0]["outcome"] != "preempted":
        raise RuntimeError(f"expected a preempted attempt and a resumed one: {attempts}")
    straight, resumed = _exported(check, check.work / "runs" / "tiny-zero2"), _exported(check, cut)
    if straight.keys() != resumed.keys():
        raise RuntimeError(f"the resumed run has other tensors: {sorted(set(straight) ^ set(resumed))[:5]}")
    differ = {name: float((straight[name].float() - resumed[name].float()).abs().max()) for name in straight
              if not torch.equal(straight[name], resumed[name])}
    if differ:  # the size says which: a resume bug is large, a non-deterministic CUDA kernel a few ulps
        raise RuntimeError(f"resumed weights differ from the uninterrupted run in {len(differ)} tensors, "
                           f"largest difference {max(differ.values()):.3g}: {dict(list(differ.items())[:5])}")
    return {"attempts": [(a["outcome"], a["start_step"], a.get("end_step")) for a in attempts],
            "tensors_compared": len(straight), "bitwise_equal": True}


def step_user_checkpoint(check: Check) -> dict[str, Any]:
    """examples/own_loop: ctx.checkpoint saves at the signal, the requeued attempt loads it and finishes. One rank in
    the dry run too (the program's two-rank stop: tests/rank/program)."""
    job = _job(check, "own-loop", job={"program": str(REPO / "examples" / "own_loop" / "loop.py") + ":main",
                                       "tasks_per_node": 1},
               params={"steps": 400, "lr": 1e-2, "save_every": 100})  # long enough for the stop to agree
    process = _submit(check, job)
    run_dir = check.work / "runs" / "own-loop"
    _signal_at(run_dir, 20, process)
    _finish(process, "the user function")
    attempts = _attempts(run_dir)
    if len(attempts) < 2 or attempts[-1]["outcome"] != "completed" or attempts[-1]["start_step"] <= 0:
        raise RuntimeError(f"the second attempt did not start from the saved step: {attempts}")
    return {"attempts": [(a["outcome"], a["start_step"], a.get("end_step")) for a in attempts]}


def step_bench(check: Check) -> dict[str, Any]:
    out = check.work / "bench.json"
    sizes = "1K..1M" if check.dry else "1M..256M"
    ranks = str(check.ranks) if check.dry else "1"
    result = subprocess.run([sys.executable, "-m", "hpc_train", "bench", "allreduce", "--ranks", ranks, "--sizes",
                             sizes, "--iters", "5", "--json", "--out", str(out)], cwd=check.work,
                            capture_output=True, text=True, timeout=300, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"bench exited {result.returncode}: {result.stderr[-1500:]}")
    return json.loads(out.read_text())


def step_hang(check: Check) -> dict[str, Any]:
    """Rank 0 hangs at step 3: the watchdog dumps every rank's stacks and, on NCCL, the flight recorder."""
    job = _job(check, "hang", job={"tasks_per_node": 1}, env={"HPC_TRAIN_INJECT_FAULT": "hang:0",
                                                              "HPC_TRAIN_INJECT_FAULT_STEP": "3"},
               watchdog={"step_timeout_s": 10, "startup_timeout_s": 120}, retry={"hang": 0})
    process = _submit(check, job)
    output, _ = process.communicate(timeout=300)
    logs = check.work / "runs" / "hang" / "logs"
    stacks = sorted(p.name for p in logs.glob("stacks-rank-*.txt"))
    traces = sorted(p.name for p in (logs / "nccl-trace").glob("*")) if (logs / "nccl-trace").is_dir() else []
    outcome = _attempts(check.work / "runs" / "hang")[-1]["outcome"]
    if outcome != "hang" or not stacks:
        raise RuntimeError(f"no hang recorded (outcome {outcome}, stacks {stacks}): {output[-1500:]}")
    if not check.dry and not traces:
        raise RuntimeError("the watchdog found the hang but NCCL's flight recorder wrote no dump")
    return {"outcome": outcome, "stacks": stacks,
            "flight_recorder": traces or "gloo has no flight recorder (dry run)"}


def step_relife(check: Check) -> dict[str, Any]:
    """A warm restart's CUDA side in one process (benchmarks/gpu_relife.py): the NCCL group aborted, the engine
    freed, the device memory back, the context kept, a second life bitwise equal to the first, pinned staging."""
    result = subprocess.run([sys.executable, str(REPO / "benchmarks" / "gpu_relife.py"), "--device",
                             "cpu" if check.dry else "cuda"], cwd=check.work, capture_output=True, text=True,
                            timeout=300, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"gpu_relife.py exited {result.returncode}: {result.stderr[-1500:]}")
    found = json.loads(result.stdout.strip().splitlines()[-1])
    memory = found["memory_allocated"]
    problems = [what for what, bad in (
        ("the second life differs from the first", not found["bitwise_equal"]),
        ("the first engine outlived its release", not found["first_engine_freed"]),
        ("device memory not given back", memory["after_release"] > memory["before"]),
        ("the CUDA context was lost", not check.dry and not found["cuda_context_kept"]),
        ("staging not pinned", not check.dry and not found["staging"]["pinned"]),
        ("the writer thread outlived close()", not found["staging"]["writer_thread_ended"])) if bad]
    if problems:
        raise RuntimeError(f"{'; '.join(problems)}: {found}")
    return found


def _baseline(model: str, seq_len: int, micro: int, steps: int, compiled: bool, vocab: int) -> dict[str, Any]:
    command = [sys.executable, str(REPO / "benchmarks" / "gpu_baseline.py"), "--model", model, "--seq-len",
               str(seq_len), "--micro-batch", str(micro), "--steps", str(steps), "--vocab", str(vocab)]
    result = subprocess.run([*command, *(["--compile"] if compiled else [])], capture_output=True, text=True,
                            timeout=480, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"the baseline loop exited {result.returncode}: {result.stderr[-1500:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def step_mfu(check: Check) -> dict[str, Any]:
    """tokens/s and MFU of hpc_train against the nanoGPT-style loop, same model, batch and bf16."""
    models = [("tiny", 128, 8, 8)] if check.dry else [("125M", 1024, 8, 20), ("1.3B", 1024, 8, 20)]
    vocab = 256 if check.dry else 50304  # GPT-2's vocabulary, rounded up to a multiple of 64
    results: dict[str, Any] = {"peak": "H200: 989 TFLOP/s dense bf16, the same GH100 compute as H100 SXM"}
    for model, seq_len, micro, steps in models:
        if check.dry:  # the trainer step's tiny run, the same model and batch: on CPUs only the code path counts
            ours = _train(check, "tiny-zero2", **TINY)
        else:
            ours = _train(check, f"mfu-{model}", train={"model": model, "seq_len": seq_len, "micro_batch": micro,
                                                        "steps": steps}, data={"vocab_size": vocab},
                          monitor={"log_every": 4})
        eager = _baseline(model, seq_len, micro, steps, compiled=False, vocab=vocab)
        row: dict[str, Any] = {"hpc_train": ours, "loop": eager,
                               "ratio": ours["tokens_per_s"] / check.ranks / eager["tokens_per_s"]}
        row["loop_compiled"] = ("skipped: torch.compile takes minutes on a CPU" if check.dry else
                                _baseline(model, seq_len, micro, steps, compiled=True, vocab=vocab))
        if check.dry:
            row["fsdp2"] = "skipped: on CPUs only the code path counts (the trainer step's tiny-fsdp2 run)"
        else:  # the same model and batch on the FSDP2 engine, bf16 params with fp32 gradient reduction
            fsdp2 = _train(check, f"mfu-{model}-fsdp2", train={"model": model, "seq_len": seq_len,
                                                               "micro_batch": micro, "steps": steps,
                                                               "engine": "fsdp2"},
                           data={"vocab_size": vocab}, monitor={"log_every": 4})
            row["fsdp2"] = {**fsdp2, "ratio_to_deepspeed": fsdp2["tokens_per_s"] / ours["tokens_per_s"]}
        if check.dry:
            row["fsdp2_compiled"] = ("skipped: inductor compiles about 30 s a rank on a CPU (tests/rank/train/"
                                     "test_compiling.py runs the path with aot_eager)")
        else:  # FSDP2 again with train.compile (inductor, each block): the first logged window holds the compile
            compiled = _train(check, f"mfu-{model}-fsdp2-compiled",
                              train={"model": model, "seq_len": seq_len, "micro_batch": micro, "steps": steps,
                                     "engine": "fsdp2", "compile": True},
                              data={"vocab_size": vocab}, monitor={"log_every": 4})
            row["fsdp2_compiled"] = {**compiled, "ratio_to_eager": compiled["tokens_per_s"] / fsdp2["tokens_per_s"]}
        results[model] = row
    return results


STEPS: dict[str, Callable[[Check], dict[str, Any]]] = {
    "environment": step_environment, "trainer": step_trainer, "resume": step_resume,
    "user_checkpoint": step_user_checkpoint, "bench": step_bench, "hang": step_hang, "relife": step_relife,
    "mfu": step_mfu,
}


def run_steps(check: Check, names: list[str], out: Path) -> bool:
    """Every step in order; the report is rewritten after each, so a run cut short still tells what it found."""
    ok = True
    for name in names:
        started = time.monotonic()
        try:
            entry = {"status": "passed", "result": STEPS[name](check)}
        except PartsFailedError as failed:
            entry, ok = {"status": "failed", "result": failed.results}, False
        except Exception as error:  # a failed step is a finding, and the next steps still run
            entry, ok = {"status": "failed", "error": f"{type(error).__name__}: {error}"[-3000:]}, False
        entry["seconds"] = round(time.monotonic() - started, 1)
        check.report["steps"][name] = entry
        out.write_text(json.dumps(check.report, indent=2, default=str) + "\n", encoding="utf-8")
        print(f"gpu_check: {name}: {entry['status']} ({entry['seconds']} s)", flush=True)
    return ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu-dry-run", action="store_true", help="the same steps on CPUs: gloo, fp32, tiny")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "gpu-check.json")
    parser.add_argument("--work", type=Path, default=None, help="scratch folder (default: a new one in /tmp)")
    parser.add_argument("--only", default=",".join(STEPS), help=f"steps to run, of {', '.join(STEPS)}")
    args = parser.parse_args(argv)
    names = [name.strip() for name in args.only.split(",") if name.strip()]
    unknown = sorted(set(names) - set(STEPS))
    if unknown:
        parser.error(f"unknown steps {unknown}; the steps are {', '.join(STEPS)}")
    import tempfile

    work = args.work or Path(tempfile.mkdtemp(prefix="gpu-check-"))
    work.mkdir(parents=True, exist_ok=True)
    check = Check(work.resolve(), args.cpu_dry_run)
    _gpu_site(check.work)
    check.report = {"command": " ".join(["scripts/gpu_check.sh", *(argv if argv is not None else sys.argv[1:])]),
                    "dry_run": check.dry, "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                    "steps": {}}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    ok = run_steps(check, names, args.out)
    print(f"gpu_check: {'all steps passed' if ok else 'FAILURES'}; report in {args.out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
