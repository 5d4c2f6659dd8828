"""Run folders as real jobs leave them (the texts follow what jobs on the local Slurm cluster wrote), for the
ops tests: rank logs, error files, stacks, attempts, metrics, the batch output, and sacct / squeue answers."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from hpc_train.backends.scheduler import SlurmRecord, StepRecord
from hpc_train.run.node_log import node_log_name

T0 = datetime(2026, 11, 30, 3, 15, 30).timestamp()
GLOO_CLOSED = ("RuntimeError('[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection "
               "closed by peer [127.0.0.1]:54679. This is typically caused by a remote worker crashing.')")
NCCL_TIMEOUT = ("DistBackendError('[Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=812, "
                "OpType=ALLREDUCE, NumelIn=1, NumelOut=1, Timeout(ms)=600000) ran for 600042 milliseconds before "
                "timing out.')")


def stamp(offset: float) -> str:
    """The rank log's timestamp ``offset`` seconds after T0."""
    moment = datetime.fromtimestamp(T0 + offset)
    return moment.strftime("%Y-%m-%d %H:%M:%S,") + f"{moment.microsecond // 1000:03d}"


def traceback_text(frames: list[tuple[str, int, str]], last: str) -> str:
    lines = ["Traceback (most recent call last):"]
    for path, line, function in frames:
        lines += [f'  File "{path}", line {line}, in {function}', "    ..."]
    return "\n".join([*lines, last]) + "\n"


def user_traceback(error: str = "RuntimeError: injected fault on rank 1 (HPC_TRAIN_INJECT_FAULT=raise:1)",
                   where: tuple[str, int, str] = ("/work/main/hpc_train/distributed/faults.py", 52,
                                                  "maybe_inject_fault")) -> str:
    return traceback_text([("/work/main/hpc_train/launch.py", 74, "_run_rank"),
                           ("/work/main/hpc_train/train/trainer.py", 253, "_train_watched"), where], error)


def comm_traceback(error: str) -> str:
    return traceback_text([("/work/main/hpc_train/launch.py", 74, "_run_rank"),
                           ("/work/main/hpc_train/train/stragglers.py", 66, "check"),
                           ("/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py", 4287,
                            "all_gather")], error)


@dataclass
class Rank:
    """One rank's files: its log lines after the start line, and optionally an error and stacks."""

    rank: int
    node_index: int
    lines: list[tuple[float, str, str]] = field(default_factory=list)  # (offset, level, message)
    error: str = ""
    traceback: str = ""
    error_at: float | None = None
    stacks: str = ""


def write_rank(run_dir: Path, job: str, rank: Rank, world: int = 2, nodes: int = 2, restart: int = 0,
               host: str = "vm", launcher: str = "srun", start_at: float = 0.0, one_rank_log: bool = False) -> None:
    """Append one attempt of ``rank`` to its node's log (as launch.py writes it; ``one_rank_log``: to
    ``rank-N.log``, as older versions did) and write its error / stacks files."""
    logs = run_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    lines = [f"{stamp(start_at)} rank{rank.rank} INFO start: {launcher} rank {rank.rank}/{world} (local 0/1, node "
             f"{rank.node_index}/{nodes}) job {job} restart {restart}"]
    for offset, level, message in rank.lines:
        lines.append(f"{stamp(offset)} rank{rank.rank} {level} {message}")
    if rank.error:
        at = rank.error_at if rank.error_at is not None else 10.0
        lines.append(f"{stamp(at)} rank{rank.rank} ERROR failed:\n{rank.traceback}")
        report = {"rank": rank.rank, "host": host, "time": T0 + at, "error": rank.error, "traceback": rank.traceback}
        (logs / f"rank-{rank.rank}.error.json").write_text(json.dumps(report, indent=2) + "\n")
    name = f"rank-{rank.rank}.log" if one_rank_log else node_log_name(rank.rank, max(1, world // max(1, nodes)))
    with open(logs / name, "a", encoding="utf-8") as out:
        out.write("\n".join(lines) + "\n")
    if rank.stacks:
        (logs / f"stacks-rank-{rank.rank}.txt").write_text(rank.stacks)


def stacks_dump(rank: int, main_frames: list[str]) -> str:
    """A dump in the watchdog's format: header, the watchdog's own thread, then the main thread."""
    main = "0x00007f482167fb80"
    frames = "\n".join(f'  File "{frame}", line 10 in f' for frame in main_frames)
    return (f"# rank {rank} on vm, pid 3721, 2026-11-30 03:15:20: phase step, step 29, 11 s since progress\n"
            "# hang: no progress for 11 s in step after step 29, noticed by rank 0 (vm)\n"
            f"# main thread {main}\n"
            "Current thread 0x00007f47fdfff6c0 (most recent call first):\n"
            '  File "/work/main/hpc_train/runtime/watchdog.py", line 198 in _dump_stacks\n\n'
            f"Thread {main} (most recent call first):\n{frames}\n\n")


def write_batch(run_dir: Path, job: str, text: str, task: int = 0) -> None:
    """submitit's batch stderr (srun and slurmstepd write here)."""
    folder = run_dir / "submitit"
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / f"{job}_{task}_log.err", "a", encoding="utf-8") as out:
        out.write(text)


def write_plan(run_dir: Path, name: str = "tiny-gpt", executor: str = "slurm", steps: int = 300) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    plan = {"name": name, "executor": executor, "run_dir": str(run_dir),
            "config": {"job": {"program": "train"}, "train": {"steps": steps}, "retry": {"hang": 2}}}
    (run_dir / "plan.json").write_text(json.dumps(plan))
    (run_dir / "logs").mkdir(exist_ok=True)


def write_attempts(run_dir: Path, attempts: list[dict]) -> None:
    base = {"restart": 0, "host": "vm", "start_step": 0, "outcome": "running", "ended": None, "end_step": None,
            "signal": None, "requeued": False, "step_s_max": None, "save_s_max": None, "note": ""}
    lines = [json.dumps({**base, "attempt": i + 1, **a}) for i, a in enumerate(attempts)]
    (run_dir / "attempts.jsonl").write_text("\n".join(lines) + "\n")


def write_metrics(run_dir: Path, steps: range, start: float, seconds_per_step: float, loss0: float = 5.0) -> None:
    records = [{"step": s, "loss": loss0 - 0.01 * s, "lr": 1e-3, "grad_norm": 1.0, "tokens_per_s": 18000.0,
                "mfu": 0.42, "step_time_s": seconds_per_step * 0.9, "memory_bytes": 1, "time": start + s *
                seconds_per_step} for s in steps]
    records.insert(len(records) // 2, {"step": records[len(records) // 2]["step"], "eval_loss": 2.0})
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def write_checkpoint(run_dir: Path, step: int) -> None:
    folder = run_dir / "checkpoints"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"step-{step:08d}").mkdir(exist_ok=True)
    (folder / "latest").write_text(f"step-{step:08d}")


def record(job: str, state: str, exit_code: str = "0:0", nodes: str = "n[1-2]", steps: tuple = (),
           elapsed_s: float | None = 60.0, limit_s: float | None = 1800.0, reason: str = "") -> SlurmRecord:
    return SlurmRecord(job, state, exit_code, nodes, reason, elapsed_s=elapsed_s, limit_s=limit_s, raw_id=job,
                       steps=tuple(StepRecord(*s) for s in steps))


def sacct_line(job: str, state: str, exit_code: str = "0:0", nodes: str = "n[1-2]", reason: str = "None",
               elapsed: str = "00:01:00", limit: str = "00:30:00", raw: str = "") -> str:
    """One ``sacct --parsable2`` row in SACCT_FIELDS order."""
    return "|".join([job, raw or job, state, exit_code, nodes, reason, "2026-11-30T03:15:03", "Unknown", elapsed,
                     limit])


def squeue_line(job: str, state: str, nodes: str = "", reason: str = "None", stdout: str = "", workdir: str = "/tmp",
                array: str = "N/A") -> str:
    """One ``squeue -O ...:|`` row in SQUEUE_FIELDS order."""
    return "|".join([job, array, state, nodes, reason, stdout, workdir, "tiny-gpt", "0:14", "30:00"]) + "|"
