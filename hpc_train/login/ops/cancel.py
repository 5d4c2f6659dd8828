"""``hpc_train cancel RUN_DIR`` and ``Job.cancel()``: end a run's current job, say so in the run folder.

On Slurm it is ``scancel`` of the job now carrying the run (a chain's newest, an array task's own id), with the
cancel recorded first so that ``status`` says "cancelled: by the user" and the follower does not call it a
failure; a scancel that fails takes the record back. On the local executor the job is a submitit controller
process on this machine with the ranks below it: the controller goes first (so it neither restarts the ranks
nor prints a traceback), then the ranks, and the attempt they leave ``running`` is closed as ``cancelled``.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path

from hpc_train.backends import LocalBackend, executor_backend
from hpc_train.errors import ConfigError
from hpc_train.login.slurm.follow import record_cancel
from hpc_train.run.attempts import AttemptLog
from hpc_train.run.files import refuse_link, run_file_stat, small_int
from hpc_train.run.paths import PLAN_FILE, SUBMITIT_DIR, follower_cancel_path
from hpc_train.run.procs import command_line, descendants, processes

__all__ = ["cancel_local", "cancel_run", "local_controller"]

REASON = "hpc_train cancel"
_ACTIVE = {"PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "RESIZING",
           "SUSPENDED", "STOPPED", "PREEMPTED"}


def cancel_run(run_dir: Path, reason: str = REASON) -> str:
    """Cancel the run's current job and return what was done, in one line; ConfigError when no job of the run
    is queued or running (exit 2: nothing to cancel)."""
    from hpc_train.login.ops import status

    run_dir = Path(run_dir)
    refuse_link(run_dir)
    if run_file_stat(run_dir / PLAN_FILE) is None:
        raise ConfigError(str(run_dir), f"is not a run folder (no {PLAN_FILE})", "give a run folder, like "
                          "runs/tiny-gpt (hpc_train status lists them)")
    if executor_backend(status.read_folder(run_dir).executor) is LocalBackend:
        pid = local_controller(run_dir)
        if pid is None:
            raise ConfigError(str(run_dir), "has no local job running here", "nothing to cancel; hpc_train status "
                              f"{run_dir} shows how it ended")
        cancel_local(run_dir, pid, reason)
        return f"cancelled local job {pid}; run folder {run_dir}"
    found = status.collect([run_dir])[0][0]
    if found.state.split()[0].upper() not in _ACTIVE or not found.job_id:
        raise ConfigError(str(run_dir), f"has no job queued or running (its newest job {found.job_id or '?'} is "
                          f"{found.state})", f"nothing to cancel; hpc_train status {run_dir} shows how it ended")
    record_cancel(run_dir, found.job_id, "user", reason)
    result = subprocess.run(["scancel", found.job_id], capture_output=True, text=True, timeout=60, check=False)
    if result.returncode != 0:
        with contextlib.suppress(OSError):  # nothing was cancelled: a later end of the job is not the user's
            follower_cancel_path(run_dir).unlink()
        raise ConfigError(f"scancel {found.job_id}", (result.stderr or result.stdout).strip()[:300] or
                          f"exit status {result.returncode}", "check the job with squeue; only its owner may "
                          "cancel it")
    return f"cancelled job {found.job_id} ({found.state}); run folder {run_dir}"


def local_controller(run_dir: Path) -> int | None:
    """The pid of submitit's local controller now running this run (its newest running attempt's job id), or
    None; never another process that got the same id."""
    running = [a for a in AttemptLog(run_dir).read() if a.outcome == "running"]
    pid = small_int(running[-1].job_id) if running else None
    return pid if pid is not None and _is_controller(pid, run_dir) else None


def _is_controller(pid: int, run_dir: Path) -> bool:
    """Whether ``pid`` runs submitit's local controller on this run's submitit folder: its own, or the
    ``.submitit`` beside it of a sweep or an array (paths compared resolved, so a link in run_root matches)."""
    line = command_line(pid)
    if line is None:
        return False
    words = [word.decode(errors="replace") for word in line.split(b"\0") if word]
    folders = {os.path.realpath(run_dir / SUBMITIT_DIR), os.path.realpath(run_dir.parent / ".submitit")}
    return any("submitit" in word for word in words) and any(os.path.realpath(word) in folders for word in words)


def cancel_local(run_dir: Path, pid: int, reason: str = REASON, wait_s: float = 10.0) -> None:
    """Record the cancel, stop the controller ``pid`` and every process below it, close the newest attempt left
    running (an older one left so by a crash keeps its own word)."""
    if not _is_controller(pid, run_dir):
        return  # already gone (and its id maybe another process's now): nothing of this run to stop
    record_cancel(run_dir, str(pid), "user", reason)
    below = descendants(pid)
    for process in [pid, *below]:  # the controller first: it would restart the ranks, or print a traceback
        with contextlib.suppress(OSError):
            os.kill(process, signal.SIGKILL)
    deadline = time.monotonic() + wait_s
    while _running(below) and time.monotonic() < deadline:
        time.sleep(0.05)
    log = AttemptLog(run_dir)
    running = [attempt for attempt in log.read() if attempt.outcome == "running"]
    if running:
        log.finish(running[-1], outcome="cancelled", ended=time.time(), note=f"cancelled by the user ({reason})")


def _running(pids: list[int]) -> bool:
    """Whether any of ``pids`` still runs, from one read of /proc (a zombie, which init reaps now that its parent
    is gone, has ended)."""
    wanted = set(pids)
    return any(process.pid in wanted and process.state != "Z" for process in processes())
