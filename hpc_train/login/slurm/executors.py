"""submitit executors built from a plan: ``local`` (processes on this machine) and ``slurm``.

The parameters are computed as plain data first, so the summary and ``--json`` show them without importing
submitit; :func:`submit` then hands them to submitit unchanged.
"""

from __future__ import annotations

import contextlib
import math
import os
import shlex
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from hpc_train.backends import default_executor, executor_backend
from hpc_train.config.plan import Plan
from hpc_train.errors import ConfigError
from hpc_train.login.slurm.directives import container_srun_flags, export_directive
from hpc_train.run.folder import private_folder
from hpc_train.run.paths import SUBMITIT_DIR
from hpc_train.run.procs import parent_death_signal

__all__ = ["resolve_executor", "submit", "submitit_folder", "submitit_parameters"]


def resolve_executor(requested: str, slurm_enabled: bool) -> str:
    """auto: slurm on a Slurm site, local on a site without Slurm. Slurm needs sbatch on PATH: a Slurm site's
    job (maybe 32 GPU ranks) is never quietly started as local processes instead."""
    has_sbatch = shutil.which("sbatch") is not None
    if requested == "auto":
        requested = default_executor(slurm_enabled)
    if executor_backend(requested).on_slurm and not has_sbatch:
        raise ConfigError("--executor", "slurm, but sbatch is not on PATH (is this a login node?)",
                          "run on a Slurm login node, or use --executor local")
    return requested


def submitit_folder(plans: list[Plan]) -> Path:
    """submitit keeps its pickles and logs inside the run folder, so they are private like the rest; a sweep's
    array shares one folder beside its run folders."""
    if len(plans) == 1:
        return Path(plans[0].run_dir) / SUBMITIT_DIR
    return Path(plans[0].run_dir).parent / ".submitit"


def _folder_guard(run_dir: str) -> str:
    """A shell test before srun, on the node: the ranks unpickle submitit's files from the run folder, so it
    must still be a real folder of ours that nobody else can write (not a link, not replaced since submit)."""
    folder, pickles = shlex.quote(run_dir), shlex.quote(f"{run_dir}/{SUBMITIT_DIR}")
    shared = f'[ -n "$(find {folder} {pickles} -maxdepth 0 -perm /022 2>/dev/null)" ]'
    refusal = f"echo 'hpc_train: refusing the run folder' {folder} '(a link, not yours, or writable by others)' >&2"
    return f"if [ -L {folder} ] || {{ [ -e {folder} ] && [ ! -O {folder} ]; }} || {shared}; then {refusal}; exit 2; fi"


def _setup_lines(plan: Plan) -> list[str]:
    """Shell lines submitit puts before srun: module loads and exports, every value quoted."""
    lines = [_folder_guard(plan.run_dir)]
    lines += [f"module load {shlex.quote(module)}" for module in plan.modules]
    if plan.modules:
        lines.insert(1, "module purge")
    lines += [f"export {name}={shlex.quote(value)}" for name, value in sorted(plan.env.items())]
    lines.append(f"export SUBMITIT_PREEMPT_SIGNAL={plan.signal}")  # submitit's handler on the node reads it
    lines.append("export SLURM_EXPORT_ENV=ALL")
    lines.append('export SRUN_CPUS_PER_TASK="$SLURM_CPUS_PER_TASK"')
    return lines


def submitit_parameters(plan: Plan) -> dict[str, Any]:
    """The keyword arguments for ``executor.update_parameters``."""
    if plan.backend.on_slurm and plan.container["runtime"] == "apptainer":
        raise ConfigError("--executor", "submitit cannot start ranks inside apptainer on this site",
                          "render the script (python -m hpc_train render) and submit it with sbatch")
    res = plan.resources
    if plan.backend.on_slurm and plan.survives_lost_node:
        key = "job.spare_nodes" if res.spare_nodes else "retry.shrink"
        raise ConfigError(key, "submitit's job would end FAILED whenever a node is lost, even when the run went on "
                          "without it and completed", "render the srun template and submit it: "
                          "python -m hpc_train render CONFIG --template srun --out job.sbatch; sbatch job.sbatch")
    minutes = max(1, math.ceil(res.time_seconds / 60))
    if not plan.backend.on_slurm:
        params: dict[str, Any] = {"tasks_per_node": plan.layout.world, "timeout_min": minutes,
                                  "signal_delay_s": plan.lead_seconds}
        if res.gpus_per_node:
            params["gpus_per_node"] = res.gpus_per_node
        return params
    # Where the node's agent starts its ranks (retry.in_place), submitit runs one task per node with its CPUs.
    per_node = 1 if plan.node_agents else res.tasks_per_node
    params = {
        "job_name": plan.name, "nodes": res.nodes, "ntasks_per_node": per_node,
        "cpus_per_task": res.cpus_per_task * (res.tasks_per_node // per_node), "time": minutes,
        "signal_delay_s": plan.lead_seconds,
        "setup": _setup_lines(plan),
        "additional_parameters": {"export": export_directive(plan), "open-mode": "append"},
    }
    if res.gpus_per_node:
        if res.gpu_directive == "gres":
            params["gres"] = f"gpu:{res.gpus_per_node}"
        else:
            params["gpus_per_node"] = res.gpus_per_node
    for key in ("mem", "partition", "account", "qos", "constraint", "exclude"):
        value = getattr(res, key)
        if value:
            params[key] = value
    if res.exclusive:
        params["exclusive"] = True
    if plan.env.get("HPC_TRAIN_REQUEUE") == "dependency":  # the site disables requeue (hpc_train.run.chain)
        params["additional_parameters"]["no-requeue"] = True
    # A rank that fails ends the step at once instead of leaving the others waiting in a collective.
    params["srun_args"] = ["--kill-on-bad-exit=1", *plan.srun_args, *container_srun_flags(plan)]
    return params


def submit(plans: list[Plan], tied: bool = False) -> list[Any]:
    """Submit the rank entry point of each plan through submitit; several plans become one job array.
    ``tied``: a local job ends when this process does (``submit`` following it).

    The plans of a sweep differ only in what runs, never in resources, so they share one executor: on Slurm
    that is one ``sbatch --array`` call, and each array task reads the plan in its own run folder.
    """
    saved = dict(os.environ)
    try:
        return _submit(plans, tied)
    finally:  # the local executor's processes took their environment at submit: this process gets its own back
        os.environ.clear()
        os.environ.update(saved)


def _submit(plans: list[Plan], tied: bool) -> list[Any]:
    first = plans[0]
    os.environ["SUBMITIT_PREEMPT_SIGNAL"] = first.signal  # submitit reads it when it writes the script
    import submitit

    from hpc_train.launch import RankEntry

    folder = submitit_folder(plans)
    private_folder(folder)  # it holds the pickles every rank unpickles
    executor: Any
    if not first.backend.on_slurm:
        executor = submitit.LocalExecutor(folder=folder, max_num_timeout=first.max_requeues)
        # The ranks must not inherit a rendezvous from this shell (it would win over ours).
        for name in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK"):
            os.environ.pop(name, None)
        os.environ.update(first.env)
    else:
        executor = submitit.SlurmExecutor(folder=folder, max_num_timeout=first.max_requeues, python=first.python)
    executor.update_parameters(**submitit_parameters(first))
    with _local_controllers_in_their_own_session(not first.backend.on_slurm, tied):
        if len(plans) == 1:
            return [executor.submit(RankEntry(first.run_dir))]
        with executor.batch():
            jobs = [executor.submit(RankEntry(plan.run_dir)) for plan in plans]
    return jobs


class _SessionPopen:
    """submitit's local module's view of ``subprocess``: every process it starts leads a session of its own,
    and when ``tied`` is killed when this process ends (its ranks follow it: they die with their parent)."""

    def __init__(self, real: Any, tied: bool) -> None:
        self._real, self._tied = real, tied

    def Popen(self, *args: Any, **kwargs: Any) -> Any:  # noqa: N802 - subprocess's own name
        if self._tied:  # submit, single-threaded here: the tie is to its main thread, which follows the job
            kwargs["preexec_fn"] = parent_death_signal()
        return self._real.Popen(*args, start_new_session=True, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


@contextlib.contextmanager
def _local_controllers_in_their_own_session(local: bool, tied: bool) -> Iterator[None]:
    """Start the local executor's controller (and so its ranks) outside the terminal's process group, so that a
    Ctrl-C reaches ``submit`` alone: it then ends the ranks and records the cancel (:mod:`hpc_train.login.ops.cancel`)
    instead of submitit's controller printing a KeyboardInterrupt traceback while the ranks record a failure.
    Only submitit's local module sees the change, for the length of the submission."""
    if not local:
        yield
        return
    from submitit.local import local as submitit_local

    real = submitit_local.subprocess
    submitit_local.subprocess = _SessionPopen(real, tied)  # type: ignore[assignment]
    try:
        yield
    finally:
        submitit_local.subprocess = real
