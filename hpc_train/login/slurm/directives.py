"""``#SBATCH`` directives of a plan, each value checked once more right where it is written.

Config checks already refused bad characters per field; this second, generic check keeps a directive to a
single ``--flag=value`` token whatever a future field forgets: no whitespace, no control characters, no ``#``.
"""

from __future__ import annotations

import re
from pathlib import PurePosixPath

from hpc_train.config.plan import Plan
from hpc_train.run.paths import LOGS_DIR

__all__ = ["directive", "export_directive", "log_paths", "sbatch_directives"]

_SAFE_VALUE = re.compile(r"[A-Za-z0-9._/+@,:=%&|\[\]*()-]+")


def directive(flag: str, value: str | int | None = None) -> str:
    """``--flag=value`` for one ``#SBATCH`` line; ValueError if the value could leave its line."""
    if value is None:
        return f"--{flag}"
    text = str(value)
    if not _SAFE_VALUE.fullmatch(text):
        raise ValueError(f"unsafe #SBATCH value for --{flag}: {text!r}")
    return f"--{flag}={text}"


def log_paths(plan: Plan) -> tuple[str, str]:
    """Batch-step stdout/stderr in the run folder; %j keeps attempts of a requeued job apart."""
    logs = PurePosixPath(plan.run_dir) / LOGS_DIR
    return str(logs / "slurm-%j.out"), str(logs / "slurm-%j.err")


def export_directive(plan: Plan) -> str:
    """NONE, or only the names the job forwards: the submitting shell's secrets never reach the job."""
    return ",".join(plan.forward_env) if plan.forward_env else "NONE"


def sbatch_directives(plan: Plan, launcher: str) -> list[str]:
    """Directives for ``launcher``: mpirun starts one task per rank; torchrun one per node, and so does srun where
    the node's agent starts its ranks (:attr:`Plan.node_agents`); srun without agents one per rank."""
    res = plan.resources
    per_node_task = launcher == "torchrun" or (launcher == "srun" and plan.node_agents)
    per_node = 1 if per_node_task else res.tasks_per_node
    cpus = res.cpus_per_task * (res.tasks_per_node if per_node_task else 1)
    out, err = log_paths(plan)
    lines = [
        directive("job-name", plan.name),
        directive("nodes", res.nodes + res.spare_nodes),  # the spares are allocated too
        directive("ntasks-per-node", per_node),
        directive("cpus-per-task", cpus),
    ]
    if res.gpus_per_node:
        if res.gpu_directive == "gres":
            lines.append(directive("gres", f"gpu:{res.gpus_per_node}"))
        else:
            lines.append(directive("gpus-per-node", res.gpus_per_node))
    if res.mem:
        lines.append(directive("mem", res.mem))
    lines.append(directive("time", res.time))
    for flag, value in (("partition", res.partition), ("account", res.account), ("qos", res.qos),
                        ("constraint", res.constraint), ("exclude", res.exclude)):
        if value:
            lines.append(directive(flag, value))
    if res.exclusive:
        lines.append(directive("exclusive"))
    if plan.survives_lost_node:  # a lost node must not end the job: a spare or the nodes left go on
        lines.append(directive("no-kill"))
    lines += [
        directive("output", out),
        directive("error", err),
        directive("open-mode", "append"),
        directive("export", export_directive(plan)),
        directive("chdir", plan.run_dir),
    ]
    if plan.requeue and plan.env.get("HPC_TRAIN_REQUEUE") != "dependency":
        lines.append(directive("requeue"))
    elif plan.requeue:  # the site disables requeue: the next attempt is a new job (hpc_train.run.chain)
        lines.append(directive("no-requeue"))
    # No "B:": the signal goes to every job step (the ranks), not only to the batch shell.
    lines.append(directive("signal", f"{plan.signal}@{plan.lead_seconds}"))
    return lines


def container_srun_flags(plan: Plan) -> list[str]:
    """srun flags of pyxis containers; empty for other runtimes."""
    container = plan.container
    if container["runtime"] != "pyxis":
        return []
    flags = [f"--container-image={container['image']}"]
    if container["mounts"]:
        flags.append(f"--container-mounts={','.join(container['mounts'])}")
    return flags
