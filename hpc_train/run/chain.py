"""The next attempt as a new job, for sites that forbid ``scontrol requeue`` (``[slurm] requeue = "dependency"``).

Rank 0 submits the job's own batch script again (``scontrol write batch_script``), with
``--dependency=afterany:<this job>``, into the same run folder, and records the link in ``chain/JOB.json``. The
new job starts once this one has ended, and it resumes from the checkpoint this one saved. ``status``, ``logs``,
``ckpt`` and the follower read these records to follow the chain of job ids as one run. Cancelling the job that
is current ends the chain: the running one, before a signal makes its successor, or the successor while it
waits.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from hpc_train.control.publish import publish
from hpc_train.run.files import atomic_write, read_json_object
from hpc_train.run.paths import SUBMITIT_DIR

__all__ = ["CHAIN_DIR", "REQUEUE_ENV", "chain_of", "handover_key", "jobs_before", "links_before", "record_successor",
           "submit_successor", "successor_of"]

CHAIN_DIR = "chain"
REQUEUE_ENV = "HPC_TRAIN_REQUEUE"  # "dependency" on ranks whose site forbids scontrol requeue
Runner = Callable[..., "subprocess.CompletedProcess[str]"]
# What this job's Slurm, launcher and rank set, which the next job must not inherit through sbatch's --export.
_JOB_PREFIXES = ("SLURM_", "SBATCH_", "SRUN_", "SALLOC_", "PMI_", "PMIX_", "OMPI_COMM_", "TORCHELASTIC_",
                 "SUBMITIT_", "HPC_TRAIN_IN_PLACE", "HPC_TRAIN_SHRUNK",  # the next job starts at the full size
                 "HPC_TRAIN_CONTROL")  # and has a coordinator of its own
_RANK_NAMES = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
               "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT", "NODE_RANK"}


def _record(run_dir: Path, job_id: str) -> Path:
    return Path(run_dir) / CHAIN_DIR / f"{job_id}.json"


def handover_key(job_id: str) -> str:
    """The coordinator's key that says job ``job_id`` handed the run on (:mod:`hpc_train.control`)."""
    return f"handover/{job_id}"


def record_successor(run_dir: Path, job_id: str, successor: str) -> None:
    """Job ``job_id`` of this run goes on as job ``successor``."""
    folder = Path(run_dir) / CHAIN_DIR
    folder.mkdir(mode=0o700, exist_ok=True)
    atomic_write(_record(run_dir, job_id), json.dumps({"job": job_id, "successor": successor, "time": time.time()}))
    publish(handover_key(job_id), successor)  # the job's agents hear it at once, and end what still runs


def successor_of(run_dir: Path, job_id: str) -> str | None:
    """The job that job ``job_id`` handed the run to, or None."""
    successor = read_json_object(_record(run_dir, job_id)).get("successor")
    return str(successor) if isinstance(successor, str | int) and str(successor).isdigit() else None


def chain_of(run_dir: Path, job_id: str, limit: int = 10_000) -> list[str]:
    """``job_id`` and every job after it in the chain, in order."""
    chain = [job_id]
    while len(chain) < limit and (nxt := successor_of(run_dir, chain[-1])) is not None and nxt not in chain:
        chain.append(nxt)
    return chain


def jobs_before(run_dir: Path, job_id: str) -> list[str]:
    """The jobs of the chain before ``job_id``, the nearest first."""
    folder = Path(run_dir) / CHAIN_DIR
    if not folder.is_dir():
        return []
    earlier = {}
    for path in folder.glob("*.json"):
        record = read_json_object(path)
        if str(record.get("successor", "")).isdigit():
            earlier[str(record["successor"])] = str(record.get("job", ""))
    found, current = [], job_id
    while current in earlier and len(found) < 10_000 and earlier[current] not in found:
        current = earlier[current]
        found.append(current)
    return found


def links_before(run_dir: Path, job_id: str) -> int:
    """How many jobs of the chain came before ``job_id``: the requeues so far, for ``preempt.max_requeues``."""
    return len(jobs_before(run_dir, job_id))


def _job_environment(env: Mapping[str, str]) -> dict[str, str]:
    """The rank's environment less what this job's Slurm, launcher and rank set: close to what the job was
    submitted with (sbatch exports that into the batch script, and the steps inherit it)."""
    return {name: value for name, value in env.items()
            if not name.startswith(_JOB_PREFIXES) and name not in _RANK_NAMES}


def submit_successor(run_dir: Path, job_id: str, env: Mapping[str, str], run: Runner = subprocess.run,
                     exclude: str = "") -> tuple[str | None, str]:
    """Submit this job's batch script again, to start after job ``job_id`` ends: (the new job id, what was done)
    or (None, why not). submitit's pickle of the job is copied to the new id, which its batch script reads."""
    scontrol, sbatch = shutil.which("scontrol"), shutil.which("sbatch")
    if scontrol is None or sbatch is None:
        return None, "scontrol or sbatch is not on PATH on the node, so the run cannot submit its next job"
    try:
        script = run([scontrol, "write", "batch_script", job_id, "-"], capture_output=True, text=True, timeout=60,
                     check=False)
        if script.returncode != 0 or not script.stdout.startswith("#!"):
            said = (script.stderr or script.stdout).strip()[:200]
            return None, f"scontrol write batch_script {job_id} failed: {said}"
        folder = Path(run_dir) / CHAIN_DIR
        folder.mkdir(mode=0o700, exist_ok=True)
        path = folder / f"{job_id}.sbatch"
        atomic_write(path, script.stdout, mode=0o700)
        argv = [sbatch, "--parsable", f"--dependency=afterany:{job_id}", "--kill-on-invalid-dep=yes",
                *([f"--exclude={exclude}"] if exclude else []), str(path)]
        submitted = run(argv, capture_output=True, text=True, timeout=60, check=False,
                        env=_job_environment(env), cwd=str(run_dir))
    except subprocess.TimeoutExpired as error:
        return None, f"{Path(str(error.cmd[0])).name} did not answer within 60 s"
    successor = submitted.stdout.strip().split(";")[0]
    if submitted.returncode != 0 or not successor.isdigit():
        return None, f"sbatch of the next job failed: {(submitted.stderr or submitted.stdout).strip()[:200]}"
    pickle = Path(run_dir) / SUBMITIT_DIR / f"{job_id}_submitted.pkl"
    if pickle.is_file() and not pickle.is_symlink():
        shutil.copyfile(pickle, pickle.with_name(f"{successor}_submitted.pkl"), follow_symlinks=False)
        os.chmod(pickle.with_name(f"{successor}_submitted.pkl"), 0o600)
    record_successor(run_dir, job_id, successor)
    return successor, f"submitted job {successor} to go on after job {job_id} (--dependency=afterany:{job_id})"
