"""The rich summary a user reads before anything runs: what trains, resources, rank layout, environment, run
folder."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from rich.console import Console, Group
from rich.panel import Panel
from rich.syntax import Syntax
from rich.table import Table

from hpc_train.common.terminal import shown
from hpc_train.config.plan import Plan
from hpc_train.fabric.nccl import detected_rows
from hpc_train.login.cli.training import training_rows, training_summary

__all__ = ["print_summary", "rank_placement"]


def rank_placement(plan: Plan, limit: int = 8) -> list[tuple[str, str]]:
    """(node, ranks) rows; tensor is innermost, so each node holds consecutive ranks."""
    per_node = plan.resources.tasks_per_node
    rows = []
    for node in range(min(plan.resources.nodes, limit)):
        first = node * per_node
        rows.append((f"node {node}", f"ranks {first}-{first + per_node - 1}" if per_node > 1 else f"rank {first}"))
    if plan.resources.nodes > limit:
        rows.append(("...", f"{plan.resources.nodes - limit} more nodes"))
    return rows


def _table(title: str, rows: list[tuple[str, Any]]) -> Table:
    table = Table(title=title, title_justify="left", show_header=False, box=None, pad_edge=False)
    table.add_column(style="bold cyan", no_wrap=True)
    table.add_column(overflow="fold")
    for key, value in rows:
        table.add_row(shown(key), shown(value))
    return table


def print_summary(console: Console, plan: Plan, extra_title: str = "", extra: str | dict[str, Any] = "") -> None:
    """Everything that will happen, in one screen."""
    res, lay, job = plan.resources, plan.layout, plan.config.job
    user_code = job.program not in ("train", "smoke")
    program = [("program", job.program + (f" {' '.join(job.args)}" if job.args else ""))]
    if user_code:
        program.append(("code folder", f"{plan.code_dir} (on sys.path of every rank; compute nodes must see it)"))
    head = _table("Job", [
        ("name", plan.name), ("site", plan.site), ("executor", plan.executor), *program,
        ("launcher", {"slurm": "srun (submitit)", "local": "local processes (submitit)"}.get(plan.executor, "")
         + f"; rendered scripts: {plan.launcher}"),
        ("run folder", plan.run_dir), ("python", plan.python),
    ])
    resources = _table("Resources", [
        ("nodes", res.nodes), ("tasks per node", res.tasks_per_node), ("GPUs per node", res.gpus_per_node),
        ("CPUs per task", res.cpus_per_task), ("memory per node", res.mem or "(site default)"),
        ("time limit", res.time), ("partition", res.partition or "(cluster default)"),
        ("account", res.account or "-"), ("qos", res.qos or "-"), ("constraint", res.constraint or "-"),
        ("exclude", res.exclude or "-"),
        ("preemption", f"SIG{plan.signal} {plan.lead_seconds} s before the end; "
                       + (f"requeue up to {plan.max_requeues} times" if plan.requeue else "no requeue")),
    ])
    layout = _table("Layout", [
        ("world", f"{lay.world} = tensor {lay.tensor} x pipeline {lay.pipeline} x data {lay.data}"
                  + (f" x context {lay.context}" if lay.context > 1 else "")),
        *([] if user_code else [("global batch", f"{lay.global_batch} = micro {lay.micro_batch} x accum "
                                                 f"{lay.grad_accum} x data {lay.data}")]),
        *rank_placement(plan),
    ])
    env_rows = [(name, value) for name, value in sorted(plan.env.items())]
    env_rows += [(name, f"({text})") for name, text in detected_rows(plan.nccl_detect, plan.interconnect)]
    env_rows += [(name, "(passed from your shell, not written anywhere)") for name in plan.forward_env]
    environment = _table("Rank environment", env_rows)
    training = _table("Training", training_rows(training_summary(plan)))
    parts: list[Any] = [head, training, resources, layout, environment]
    if plan.modules:
        parts.append(_table("Modules", [(str(i + 1), m) for i, m in enumerate(plan.modules)]))
    console.print(Panel(Group(*[item for part in parts for item in (part, "")][:-1]), title="hpc_train plan"))
    if isinstance(extra, dict):
        console.print(Panel(Syntax(json.dumps(extra, indent=2, sort_keys=True), "json"), title=extra_title))
    elif extra:
        console.print(Panel(Syntax(extra, "bash", word_wrap=True), title=extra_title))


def print_sweep(console: Console, plans: list[Plan], sweeps: list[str]) -> None:
    """One row per run of a sweep: its run folder and the values it sets."""
    keys = [text.partition("=")[0] for text in sweeps]
    table = Table(title=f"Sweep: {len(plans)} runs in one job array", title_justify="left")
    table.add_column("run folder")
    for key in keys:
        table.add_column(key)
    for plan in plans:
        section_values = []
        table_of = dataclasses.asdict(plan.config)
        for key in keys:
            section, _, name = key.partition(".")
            section_values.append(shown(table_of.get(section, {}).get(name, "")))
        table.add_row(shown(plan.run_dir), *section_values)
    console.print(table)
