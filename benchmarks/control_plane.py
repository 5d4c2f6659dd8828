"""The control plane at scale: what the login side and rank 0 pay for a run folder of many ranks.

    .venv/bin/python benchmarks/control_plane.py [--section login] [--ranks 1024 4096 16384] [--runs 3] [--smoke]

Section ``login``: a synthetic run folder per rank count, written with the project's own writers (the run folder
by ``run.folder.prepare_run_folder``, each rank's log lines through ``run.loglines``' formats into its node's
log (``run.node_log``, 4 ranks a node) and its ``rank-N.error.json`` by ``launch._record_failure``, as a failing
rank writes them; ``attempts.jsonl`` by
``run.attempts.AttemptLog``), where EVERY rank wrote an error: one NCCL "unhandled system error" on one rank, then
every other rank's "peer gone" consequence (an aborted communicator, ncclRemoteError). Each command then runs in a
fresh interpreter, as a user would run it, and the row gives its wall seconds (median of ``--runs``) and its peak
resident memory (the child's own ``ru_maxrss`` from ``wait4``):

- ``status RUN --json`` and ``logs RUN --errors-only --tail 20`` (``python -m hpc_train``);
- the failure classifier (``ops.evidence.collect_evidence`` then ``ops.classify.classify``, with sacct's record);
- the follower's poll of a failed job (``slurm.follow``: ``FollowedJob.rank_errors``, ``cancel_decision``,
  ``_report_failure``);
- rank 0's look-back on the requeued attempt (``ops.recovery.look_back``; sacct answered by a stand-in): it
  reads the ranks that left an error record (one listing), here every rank, and with ``4 failed`` only the
  first node's ranks' records (as when one node's ranks failed and the rest were ended by srun).

Slurm's commands are left off PATH for the commands (no scheduler knows these synthetic jobs): ``status`` shows
what the run folder says, as it does without Slurm. Targets (issue 38): each at most 1 s and 200 MiB at 16,384
ranks on a 2-core machine, and linear in ranks (the last column: time against the smallest rank count's).
The folders are built on /dev/shm when it exists (each error record's write is fsynced twice; on tmpfs that is
free, and the commands read from the page cache either way).

Other sections (steady-state run-folder operations, restart decision time) go beside :func:`login_section`:
a function ``(args) -> list[Row]`` registered in :data:`SECTIONS`.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from hpc_train.run.error_log import ERROR_LOG_ENV, error_log_name  # noqa: E402
from hpc_train.run.loglines import format_start, rank_log_format  # noqa: E402
from hpc_train.run.node_log import NodeLogHandler, node_log_path  # noqa: E402
from hpc_train.run.paths import LOGS_DIR  # noqa: E402

JOB = "4242"
TASKS_PER_NODE = 4
ROOT_FAULT = ("NCCL error in: /opt/pytorch/torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:1970, unhandled system "
              "error (run with NCCL_DEBUG=INFO for details), NCCL version 2.21.5\nncclSystemError: System call (e.g. "
              "socket, malloc) or external library call failed or device error.\nLast error:\nNET/IB : Got "
              "completion from peer 10.1.{a}.{b}<52{c:03d}> with status=12 opcode=0 len=0 vendor err 129 (Recv)")
PEER_GONE = ("[Rank {rank}] NCCL communicator was aborted on rank {rank}. Original reason for failure was: NCCL "
             "error: remote process exited or there was a network error, NCCL version 2.21.5\nncclRemoteError: A "
             "call failed possibly due to a network error or a remote process exiting prematurely.")
TARGET_S, TARGET_MIB = 1.0, 200.0


class DistBackendError(RuntimeError):
    """What torch.distributed raises on a rank whose peer went away (named as torch names it)."""


@dataclass(frozen=True)
class Row:
    section: str
    ranks: int
    what: str
    seconds: float
    cpu_s: float  # user + system: what the command costs when the machine is shared
    peak_mib: float

    @property
    def met(self) -> bool:
        return self.seconds <= TARGET_S and self.peak_mib <= TARGET_MIB


# -- the synthetic run folder, written as the ranks write it ---------------------------------------------------


def _node(rank: int) -> str:
    return f"n{rank // TASKS_PER_NODE:05d}"


def _plan(run_dir: Path, world: int) -> str:
    nodes = world // TASKS_PER_NODE
    return json.dumps({"name": run_dir.name, "executor": "slurm", "run_dir": str(run_dir),
                       "resources": {"nodes": nodes, "tasks_per_node": TASKS_PER_NODE, "gpus_per_node": 4},
                       "layout": {"world": world},
                       "config": {"job": {"program": "train"}, "train": {"steps": 10000}, "retry": {}}}, indent=2)


def _rank_logger(run_dir: Path, rank: int) -> tuple[logging.Logger, logging.Handler]:
    logger = logging.getLogger(f"control_plane.rank{rank}")
    logger.setLevel(logging.INFO)
    logger.propagate = False
    handler = NodeLogHandler(node_log_path(run_dir, rank, TASKS_PER_NODE))  # the ranks' own writer
    handler.setFormatter(logging.Formatter(rank_log_format(rank)))
    logger.handlers = [handler]
    return logger, handler


def _raise(rank: int, root: int) -> None:
    """A few frames deep, as a collective fails inside a training step."""
    def all_reduce() -> None:
        if rank == root:
            raise RuntimeError(ROOT_FAULT.format(a=rank % 250, b=rank // 250 % 250, c=rank % 1000))
        raise DistBackendError(PEER_GONE.format(rank=rank))

    def train_step() -> None:
        all_reduce()

    train_step()


def _write_rank(run_dir: Path, rank: int, world: int, root: int, record_failure: Callable[..., bool],
                node_records: bool) -> None:
    os.environ["SLURMD_NODENAME"] = _node(rank)  # run.node.node_name: the node every record names
    if node_records:  # as a node's agent tells its ranks: one error file per node (hpc_train.run.error_log)
        os.environ[ERROR_LOG_ENV] = error_log_name(rank, TASKS_PER_NODE)
    info = SimpleNamespace(rank=rank, in_place=0, job_id=JOB, restart=0)
    logger, handler = _rank_logger(run_dir, rank)
    try:
        logger.info("%s", format_start("srun", rank, world, rank % TASKS_PER_NODE, TASKS_PER_NODE,
                                       rank // TASKS_PER_NODE, world // TASKS_PER_NODE, JOB, 0, _node(rank)))
        logger.info("fabric: NCCL_IB_HCA=mlx5_0,mlx5_1 (detected on this node)")
        logger.info("bootstrap: world %d, rendezvous on %s:29500", world, _node(0))
        if rank == 0:
            for step in range(1, 41):
                logger.info("step %d loss %.4f lr 3.0e-04 tokens/s 1234567", step, 5.0 - step / 100)
        try:
            _raise(rank, root)
        except Exception as error:  # recorded as a failing rank records it
            record_failure(run_dir, None, info, error, False, logger)
    finally:
        handler.close()


def _batch_output(run_dir: Path, world: int) -> None:
    """Slurm's batch output of the job: the template's start line, srun's verdict per node, slurmstepd's cancel."""
    logs = run_dir / LOGS_DIR
    (logs / f"slurm-{JOB}.out").write_text(f"hpc_train: job {JOB} restart 0\n")
    lines = [f"srun: error: {_node(first)}: tasks {first}-{first + TASKS_PER_NODE - 1}: Exited with exit code 1"
             for first in range(0, world, TASKS_PER_NODE)]
    (logs / f"slurm-{JOB}.err").write_text("\n".join([f"hpc_train: job {JOB} restart 0", *lines]) + "\n")


def build_run_folder(run_dir: Path, world: int, node_records: bool = True) -> None:
    """A run of ``world`` ranks whose attempt 1 ended with every rank's error record: in its node's error log,
    as the ranks below a node's agent write them (``retry.in_place``, the default), or with ``node_records``
    False one file per rank, as ranks without an agent do."""
    from hpc_train.rank.entry import _record_failure
    from hpc_train.run.attempts import AttemptLog
    from hpc_train.run.folder import prepare_run_folder

    saved, saved_log = os.environ.get("SLURMD_NODENAME"), os.environ.pop(ERROR_LOG_ENV, None)
    prepare_run_folder(run_dir, _plan(run_dir, world), "[job]\nprogram = \"train\"\n", "synthetic")
    attempts = AttemptLog(run_dir)
    attempt = attempts.begin(JOB, 0, _node(0), time.time() - 600, 0)
    root = world // 3 + 1
    for rank in [root, *(r for r in range(world) if r != root)]:  # the root's record is the earliest
        _write_rank(run_dir, rank, world, root, _record_failure, node_records)
    os.environ.pop(ERROR_LOG_ENV, None)
    if saved_log is not None:
        os.environ[ERROR_LOG_ENV] = saved_log
    if saved is None:
        os.environ.pop("SLURMD_NODENAME", None)
    else:
        os.environ["SLURMD_NODENAME"] = saved
    attempts.finish(attempt, outcome="failed", ended=time.time(), end_step=40, note="rank failed")
    _batch_output(run_dir, world)


# -- the commands, each in a fresh interpreter ------------------------------------------------------------------

_CLASSIFY = """
import sys
from pathlib import Path
from hpc_train.failures.classify import classify
from hpc_train.failures.evidence import collect_evidence
from hpc_train.backends.scheduler import SlurmRecord
run, job, nodes = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
record = SlurmRecord(job, "FAILED", "1:0", nodes, raw_id=job)
print(classify(record, collect_evidence(run, job, 0)).reason)
"""
_FOLLOW = """
import io, sys
from pathlib import Path
from types import SimpleNamespace
from rich.console import Console
from hpc_train.login.slurm.follow import FollowedJob, _report_failure
job = FollowedJob(SimpleNamespace(job_id=sys.argv[2]), Path(sys.argv[1]), submitted_at=0.0, state="FAILED")
failed = bool(job.rank_errors())
decision = job.cancel_decision()
out = io.StringIO()
_report_failure(Console(file=out, width=200), job)
print(failed, decision.cancel, len(out.getvalue()))
"""
_LOOK_BACK = """
import subprocess, sys
from pathlib import Path
from hpc_train.failures import recovery
from hpc_train.failures.policy import RetryPolicy
from hpc_train.run.error_records import ranks_with_records
run, job, nodes, failed = Path(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4])
rows = [f"{job}|{job}|{state}|1:0|{nodes}|None|2026-11-30T03:15:03|2026-11-30T03:25:03|00:10:00|10:00:00"
        for state in ("FAILED", "RUNNING")]
answers = {"sacct": "\\n".join(rows) + "\\n"}
def stand_in(argv, **kwargs):
    return subprocess.CompletedProcess(argv, 0, answers.get(argv[0], ""), "")
recovery.shutil.which = lambda name: "/usr/bin/" + name  # the stand-in answers for Slurm
recorded = ranks_with_records(run)  # as rank 0 lists them; then only the first FAILED ranks' records count
print(recovery.look_back(run, job, 1, RetryPolicy(), ["m00001"], lambda line: None, stand_in,
                         failed_ranks=recorded[:failed] if failed else recorded))
"""


def _commands(run_dir: Path, world: int) -> dict[str, list[str]]:
    nodes = f"n[00000-{world // TASKS_PER_NODE - 1:05d}]"
    return {"status --json": ["-m", "hpc_train", "status", str(run_dir), "--json"],
            "logs --errors-only --tail 20": ["-m", "hpc_train", "logs", str(run_dir), "--errors-only", "--tail", "20"],
            "classifier": ["-c", _CLASSIFY, str(run_dir), JOB, nodes],
            "follower's poll": ["-c", _FOLLOW, str(run_dir), JOB],
            "look-back, 4 failed (rank 0)": ["-c", _LOOK_BACK, str(run_dir), JOB, nodes, str(TASKS_PER_NODE)],
            "look-back (rank 0)": ["-c", _LOOK_BACK, str(run_dir), JOB, nodes, "0"]}  # last: they record verdicts


def _path_without_slurm() -> str:
    keep = [d for d in os.environ.get("PATH", "").split(os.pathsep) if d and not Path(d, "squeue").exists()]
    return os.pathsep.join(keep)


def run_once(argv: list[str], env: dict[str, str]) -> tuple[float, float, float, str]:
    """(wall seconds, CPU seconds, peak RSS in MiB, stdout) of one fresh interpreter."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        start = time.perf_counter()
        proc = subprocess.Popen([sys.executable, *argv], stdout=out, stderr=err, env=env, cwd=REPO)
        _, status, usage = os.wait4(proc.pid, 0)
        seconds = time.perf_counter() - start
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        text = out.read().decode(errors="replace")
        if proc.returncode != 0:
            raise RuntimeError(f"{argv[:4]} exited {proc.returncode}: {err.read().decode(errors='replace')[-2000:]}")
    return seconds, usage.ru_utime + usage.ru_stime, usage.ru_maxrss / 1024, text


def login_section(args: argparse.Namespace) -> list[Row]:
    rows: list[Row] = []
    env = {**os.environ, "PATH": _path_without_slurm(), "PYTHONPATH": str(REPO)}
    env.pop("SLURM_JOB_ID", None)
    shm = Path("/dev/shm")  # noqa: S108 - a private TemporaryDirectory is made inside it
    base = Path(args.dir) if args.dir else shm if shm.is_dir() else None
    for world in args.ranks:
        with tempfile.TemporaryDirectory(prefix="control-plane-", dir=base) as tmp:
            run_dir = Path(tmp) / f"ranks-{world}"
            start = time.perf_counter()
            build_run_folder(run_dir, world, args.records == "node")
            print(f"built {run_dir.name}: {world} ranks, every one with an error record ({args.records} files), "
                  f"in {time.perf_counter() - start:.1f} s", flush=True)
            for what, argv in _commands(run_dir, world).items():
                runs = [run_once(argv, env) for _ in range(args.runs)]
                rows.append(Row("login", world, what, statistics.median(r[0] for r in runs),
                                statistics.median(r[1] for r in runs), max(r[2] for r in runs)))
                if args.verbose:
                    print(f"  {what}: {runs[-1][3].strip()[:300]}")
    return rows


def _coordinator(args: argparse.Namespace) -> list[Row]:
    from control_plane_coordinator import coordinator_section  # beside this script

    return coordinator_section(args)


def _cluster(args: argparse.Namespace) -> list[Row]:
    from control_plane_cluster import cluster_section  # beside this script; needs the local cluster and strace

    return cluster_section(args)


SECTIONS: dict[str, Callable[[argparse.Namespace], list[Row]]] = {"login": login_section, "coordinator": _coordinator,
                                                                   "cluster": _cluster}


def report(rows: list[Row]) -> None:
    """One table per section; the last column is the time over the smallest rank count's, against the rank ratio."""
    print(f"{'section':8} {'ranks':>6} {'what':30} {'wall s':>7} {'CPU s':>6} {'peak MiB':>9} {'x smallest':>11} "
          f"{'(ranks x)':>9} {'target':>7}")
    for row in rows:
        first = min((r for r in rows if r.section == row.section and r.what == row.what), key=lambda r: r.ranks)
        ratio = row.seconds / first.seconds if first.seconds else float("nan")
        print(f"{row.section:8} {row.ranks:6d} {row.what:30} {row.seconds:7.3f} {row.cpu_s:6.2f} {row.peak_mib:9.1f} "
              f"{ratio:11.2f} "
              f"{row.ranks / first.ranks:9.0f} {'met' if row.met else 'MISSED':>7}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--section", choices=[*SECTIONS, "all"], default="all")
    parser.add_argument("--ranks", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--nodes", type=int, nargs="+", default=[8, 32, 64],
                        help="emulated nodes, one agent each (the coordinator section)")
    parser.add_argument("--runs", type=int, default=3, help="runs of each command; the median is shown")
    parser.add_argument("--records", choices=["node", "rank"], default="node",
                        help="the login section's error records: one file per node, as ranks below a node's agent "
                        "write them (retry.in_place, the default), or one per rank (no agent)")
    parser.add_argument("--dir", help="where the run folders are built (default /dev/shm, else the temp folder)")
    parser.add_argument("--verbose", action="store_true", help="print each command's answer (its first line)")
    parser.add_argument("--smoke", action="store_true", help="64 and 256 ranks, one run: the benchmark runs end to "
                        "end in seconds (CI), its figures mean nothing")
    args = parser.parse_args()
    if args.smoke:
        args.ranks, args.runs, args.nodes = [64, 256], 1, [2, 4]
    sections = ["login", "coordinator"] if args.section == "all" else [args.section]  # cluster: by name only
    rows = [row for name in sections for row in SECTIONS[name](args)]
    report(rows)


if __name__ == "__main__":
    main()
