"""What ``python -m hpc_train doctor`` does, once its options are parsed: every check in turn, then the report.

Separate from :mod:`hpc_train.login.doctor.cli` so that registering the command costs every other command nothing.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path

from hpc_train.backends import default_executor
from hpc_train.common.terminal import print_json
from hpc_train.config.environment import detected_on_node, network_env
from hpc_train.config.plan import Plan, load_job, make_plan
from hpc_train.config.site import SiteConfig
from hpc_train.config.sites import load_site
from hpc_train.errors import ConfigError
from hpc_train.fabric.sysfs import Fabric, read_fabric
from hpc_train.login.doctor.defaults import DEFAULT_PROBE_NODES, DEFAULT_PROBE_TIMEOUT_S
from hpc_train.login.doctor.fabric_checks import check_fabric, check_nccl, nccl_env
from hpc_train.login.doctor.findings import Finding, exit_status, summary
from hpc_train.login.doctor.probe import SIGNAL_WAIT_S, ProbeOutcome, ProbeRequest, run_probe
from hpc_train.login.doctor.slurm_checks import (
    ClusterView,
    JobShape,
    Partition,
    check_partition,
    check_reachable,
    check_site,
    choose_partition,
    query_cluster,
)

__all__ = ["run_doctor"]

_STYLE = {"ok": "green", "info": "cyan", "warning": "yellow", "error": "bold red"}


def _checked(args: argparse.Namespace) -> None:
    """Every option checked before anything is asked of Slurm."""
    if args.overrides and args.config is None:
        raise ConfigError("--set", "needs a job config", "add --config JOB.toml, or drop --set")
    if not args.probe_timeout > 0 or not math.isfinite(args.probe_timeout):
        raise ConfigError("--probe-timeout", f"{args.probe_timeout} is not a positive number of seconds",
                          f"give the seconds the probe job may take to start, like {DEFAULT_PROBE_TIMEOUT_S:.0f}")
    for flag, value in (("--nodes", args.nodes), ("--ntasks-per-node", args.ntasks_per_node)):
        if value is not None and value < 1:
            raise ConfigError(flag, f"{value} is below the minimum 1", "give 1 or more")
    if not Path(args.sysfs).is_dir():
        raise ConfigError("--sysfs", f"{args.sysfs} is not a folder", "give a sysfs root such as /sys")


def _plan(args: argparse.Namespace, site: SiteConfig) -> Plan:
    return make_plan(load_job(args.config, args.overrides), site, default_executor(site.slurm.enabled),
                     config_dir=args.config.resolve().parent)


def _probe_minutes(timeout_s: float, part: Partition | None) -> int:
    """Long enough to start, report and be signalled; never past the partition's MaxTime."""
    minutes = max(5, math.ceil((timeout_s + SIGNAL_WAIT_S + 60) / 60))
    if part is not None and part.max_time_s is not None:
        minutes = max(1, min(minutes, part.max_time_s // 60))
    return minutes


def _shape(args: argparse.Namespace, plan: Plan | None, site: SiteConfig, view: ClusterView) -> JobShape:
    """The job's resources, or (without a config) the probe's: --nodes (default 2, fewer on a smaller partition)."""
    if plan is not None:
        res = plan.resources
        return JobShape(partition=res.partition, nodes=res.nodes, tasks_per_node=res.tasks_per_node,
                        cpus_per_task=res.cpus_per_task, gpus_per_node=res.gpus_per_node, time=res.time)
    shape = JobShape(partition=site.slurm.partition, nodes=args.nodes or DEFAULT_PROBE_NODES,
                     tasks_per_node=args.ntasks_per_node or 1, from_config=False)
    part = choose_partition(shape, view.partitions)
    part = part if isinstance(part, Partition) else None
    if args.nodes is None and part is not None:
        usable = [n for n in view.members(part.name) if n.usable] or view.members(part.name)
        available = len(usable) or part.total_nodes
        shape = JobShape(partition=shape.partition, nodes=max(1, min(DEFAULT_PROBE_NODES, available)),
                         tasks_per_node=shape.tasks_per_node, from_config=False)
    minutes = _probe_minutes(args.probe_timeout, part)
    return JobShape(partition=shape.partition, nodes=shape.nodes, tasks_per_node=shape.tasks_per_node,
                    time=f"{minutes // 60:02d}:{minutes % 60:02d}:00", from_config=False)


def _program_path(plan: Plan) -> str:
    """What every rank of a user program needs to see: its file, or for a module the config file's folder."""
    from hpc_train.config.program import parse_program

    program = parse_program(plan.config.job.program)
    if not program.is_user_code:
        return ""
    return program.path or plan.code_dir


def _probe_request(args: argparse.Namespace, plan: Plan | None, site: SiteConfig, shape: JobShape,
                   part: Partition | None) -> ProbeRequest:
    if plan is not None:
        res = plan.resources
        return ProbeRequest(
            nodes=args.nodes or res.nodes, tasks_per_node=args.ntasks_per_node or res.tasks_per_node,
            signal=plan.signal, run_root=str(Path(plan.run_dir).parent), python=plan.python,
            partition=res.partition, account=res.account, qos=res.qos, constraint=res.constraint,
            exclude=res.exclude, srun_args=tuple(plan.srun_args), modules=tuple(plan.modules),
            time_minutes=_probe_minutes(args.probe_timeout, part), code_path=_program_path(plan))
    slurm = site.slurm
    return ProbeRequest(
        nodes=shape.nodes, tasks_per_node=shape.tasks_per_node, signal=site.preempt.signal,
        run_root=os.path.normpath(Path.cwd() / (site.run_root or "runs")),
        python=site.software.python or sys.executable, partition=slurm.partition, account=slurm.account,
        qos=slurm.qos, constraint=slurm.constraint, srun_args=tuple(site.launch.srun_args),
        modules=tuple(site.software.modules), time_minutes=_probe_minutes(args.probe_timeout, part))


def _slurm_findings(args: argparse.Namespace, plan: Plan | None,
                    site: SiteConfig) -> tuple[list[Finding], ProbeOutcome | None]:
    """Reachability, the partition, the site's picture of it, and the probe; the probe's outcome or None."""
    if not site.slurm.enabled:
        return [Finding("slurm", "info", f"site {site.name} has no Slurm ([slurm] enabled = false): Slurm, "
                        "partition and probe checks skipped", "")], None
    findings = check_reachable()
    if any(f.is_error for f in findings):
        return findings, None
    view = query_cluster()
    findings += view.findings
    shape = _shape(args, plan, site, view)
    checked = check_partition(shape, view)
    findings += checked
    part = choose_partition(shape, view.partitions)
    part = part if isinstance(part, Partition) else None
    if part is not None:
        findings += check_site(site, part, view.members(part.name))
    if args.no_probe:
        findings.append(Finding("probe", "info", "skipped (--no-probe): signal delivery and the run folder's "
                                "visibility from the compute nodes are not checked", ""))
        return findings, None
    if any(f.is_error for f in checked):
        findings.append(Finding("probe", "info", "skipped: the job cannot run on its partition (see above)", ""))
        return findings, None
    outcome = run_probe(_probe_request(args, plan, site, shape, part), args.probe_timeout)
    return findings + outcome.findings, outcome


def _env(plan: Plan | None, site: SiteConfig) -> tuple[dict[str, str], list[str]]:
    """The rank environment the job would get, and the NCCL variables each node fills in for itself."""
    if plan is not None:
        return dict(plan.env), list(plan.nccl_detect)
    return {**network_env(site.network), **site.env}, detected_on_node(site.network)


def _print(fabric: Fabric, nccl: dict[str, str], detect: list[str], findings: list[Finding]) -> None:
    """The fabric tables (the fabric command's own), the NCCL environment, then the findings."""
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    from hpc_train.fabric.__main__ import _print_tables

    _print_tables(fabric)
    console = Console()
    if not console.is_terminal and "COLUMNS" not in os.environ:
        console = Console(width=160)  # piped or logged: keep messages on one line where they fit
    env_table = Table(title="NCCL environment", title_justify="left")
    for column in ("variable", "value", "from"):
        env_table.add_column(column, overflow="fold")
    for name, value in nccl.items():
        env_table.add_row(name, Text(value), "plan")  # values are text, never rich markup ("[...]")
    for name in detect:
        if name not in nccl:
            env_table.add_row(name, "-", "each node, at start (hpc_train.fabric.nccl)")
    if nccl or detect:
        console.print(env_table)
    else:
        console.print("NCCL environment: no NCCL_*, TORCH_NCCL_* or GLOO_* variable is set.")
    table = Table(title="Findings", title_justify="left", expand=True)
    table.add_column("severity", no_wrap=True)
    table.add_column("check", no_wrap=True)
    table.add_column("message", overflow="fold", ratio=3)
    table.add_column("fix", overflow="fold", ratio=2)
    for finding in findings:
        table.add_row(Text(finding.severity, style=_STYLE[finding.severity]), finding.check,
                      Text(finding.message), Text(finding.fix or "-"))  # "[slurm]", "n[1-2]": text, not markup
    console.print(table)
    console.print(f"[bold]doctor:[/bold] {summary(findings)}", highlight=False)


def run_doctor(args: argparse.Namespace) -> int:
    """Every check in turn; the exit status says whether any finding is an error."""
    _checked(args)

    site = load_site(args.site)
    plan = _plan(args, site) if args.config is not None else None
    findings, outcome = _slurm_findings(args, plan, site)
    fabric = read_fabric(args.sysfs)
    interconnect = site.network.interconnect
    findings += check_fabric(fabric, interconnect, site.name, in_job="SLURM_JOB_ID" in os.environ)
    env, detect = _env(plan, site)
    findings += check_nccl(env, fabric, interconnect)
    shown = nccl_env(env)
    if args.json:
        print_json({"findings": [f.to_dict() for f in findings], "fabric": fabric.to_dict(),
                    "nccl_env": shown, "nccl_detect": detect,
                    "probe": outcome.to_dict() if outcome is not None else None,
                    "summary": summary(findings)})
    else:
        _print(fabric, shown, detect, findings)
    return exit_status(findings)
