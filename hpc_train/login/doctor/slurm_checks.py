"""Is Slurm there, and can the job run on its partition?

Everything comes from two calls, ``scontrol show partition --oneliner`` (limits and state of every partition)
and ``sinfo --Node`` (CPUs, GPUs and state of every node in every partition), parsed here as plain text so the
rules can be tested on fixture strings. Commands run with argument lists and timeouts: a hung slurmctld must
make doctor report, not hang with it.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from hpc_train.config.checks import parse_time_seconds
from hpc_train.config.site import SiteConfig
from hpc_train.errors import did_you_mean
from hpc_train.login.doctor.findings import Finding

__all__ = [
    "SLURM_TIMEOUT_S",
    "ClusterView",
    "JobShape",
    "NodeInfo",
    "Partition",
    "check_partition",
    "check_reachable",
    "check_site",
    "choose_partition",
    "last_line",
    "parse_gpus",
    "parse_nodes",
    "parse_oneliner",
    "parse_partitions",
    "parse_slurm_time",
    "query_cluster",
    "run_slurm",
]

SLURM_TIMEOUT_S = 20.0
TOOLS = ("sinfo", "scontrol", "sbatch", "scancel")
NODE_FORMAT = "%N|%P|%c|%G|%T"
_KEY = re.compile(r"(?:^|\s)([A-Za-z][A-Za-z0-9_:/.]*)=")
_NO_LIMIT = frozenset({"UNLIMITED", "INFINITE", "NONE", "N/A", "(NULL)", ""})
# Node states in which no new job starts; "*" (not responding) is checked on the raw text.
_UNUSABLE = ("down", "drain", "fail", "maint", "reboot", "inval", "unknown", "future", "power", "not_responding")


def run_slurm(argv: Sequence[str], timeout: float = SLURM_TIMEOUT_S,
              env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run a Slurm client command; a missing program (127) or a timeout (124) becomes a failed result."""
    args = list(argv)
    try:
        return subprocess.run(args, capture_output=True, text=True, timeout=timeout, check=False,
                              env=dict(env) if env is not None else None)
    except FileNotFoundError:
        return subprocess.CompletedProcess(args, 127, "", f"{args[0]}: not found on PATH")
    except subprocess.TimeoutExpired:
        return subprocess.CompletedProcess(args, 124, "", f"{args[0]} did not answer within {timeout:.0f} s")
    except OSError as error:
        return subprocess.CompletedProcess(args, 126, "", f"{args[0]}: {error.strerror or error}")


def last_line(result: subprocess.CompletedProcess[str]) -> str:
    """The last line a command said (stderr first): what goes into a finding."""
    text = result.stderr or result.stdout or ""
    lines = [line.strip() for line in text.splitlines() if any(char.isalnum() for char in line)]  # no "*****"
    return lines[-1] if lines else f"exit status {result.returncode}"


# --- parsing --------------------------------------------------------------------------------------------------


def parse_oneliner(line: str) -> dict[str, str]:
    """``Key=Value Key=Value`` as scontrol's ``--oneliner`` prints it; values may hold spaces and ``=``."""
    matches = list(_KEY.finditer(line))
    fields: dict[str, str] = {}
    for index, match in enumerate(matches):
        end = matches[index + 1].start() if index + 1 < len(matches) else len(line)
        fields[match.group(1)] = line[match.end():end].strip()
    return fields


def parse_slurm_time(text: str) -> int | None:
    """Seconds of a Slurm time limit as scontrol shows it; None for UNLIMITED (or text it cannot read)."""
    value = text.strip()
    if value.upper() in _NO_LIMIT:
        return None
    return parse_time_seconds(value)


def _count(text: str) -> int | None:
    """An integer field; None for UNLIMITED and anything that is not a number."""
    value = text.strip()
    return int(value) if (value.isascii() and value.isdigit()) else None


def parse_gpus(gres: str) -> int:
    """GPUs in a gres string: ``gpu:h100:8(S:0-1)`` -> 8, ``gpu:a100:2(S:0),gpu:a100:2(S:1)`` -> 4, (null) -> 0."""
    total = 0
    for item in re.sub(r"\([^)]*\)", "", gres).split(","):
        parts = item.strip().split(":")
        if parts[0] != "gpu":
            continue
        count = parts[-1] if len(parts) > 1 else "1"
        total += int(count) if (count.isascii() and count.isdigit()) else 0
    return total


@dataclass(frozen=True)
class Partition:
    """One partition's limits as ``scontrol show partition`` states them (None: no limit)."""

    name: str
    state: str
    default: bool = False
    max_time: str = "UNLIMITED"
    max_time_s: int | None = None
    max_nodes: int | None = None
    total_nodes: int = 0
    max_cpus_per_node: int | None = None
    nodes: str = ""


@dataclass(frozen=True)
class NodeInfo:
    """One node of one partition as ``sinfo --Node`` lists it (a node in two partitions is two rows)."""

    name: str
    partition: str
    cpus: int
    gpus: int
    state: str

    @property
    def usable(self) -> bool:
        """Could a new job start here (idle, mixed or busy, but not down, drained or not responding)?"""
        state = self.state.lower()
        return not state.endswith("*") and not any(bad in state for bad in _UNUSABLE)


def parse_partitions(text: str) -> dict[str, Partition]:
    """Every partition of ``scontrol show partition --oneliner``, by name."""
    partitions: dict[str, Partition] = {}
    for line in text.splitlines():
        fields = parse_oneliner(line)
        name = fields.get("PartitionName", "")
        if not name:
            continue
        max_time = fields.get("MaxTime", "UNLIMITED") or "UNLIMITED"
        partitions[name] = Partition(
            name=name, state=fields.get("State", "UNKNOWN").upper(), default=fields.get("Default", "NO") == "YES",
            max_time=max_time, max_time_s=parse_slurm_time(max_time), max_nodes=_count(fields.get("MaxNodes", "")),
            total_nodes=_count(fields.get("TotalNodes", "")) or 0,
            max_cpus_per_node=_count(fields.get("MaxCPUsPerNode", "")),
            nodes="" if fields.get("Nodes", "").upper() in _NO_LIMIT else fields.get("Nodes", ""),
        )
    return partitions


def parse_nodes(text: str) -> list[NodeInfo]:
    """Rows of ``sinfo --noheader --Node --format=%N|%P|%c|%G|%T``; unreadable rows are skipped."""
    nodes = []
    for line in text.splitlines():
        parts = [part.strip() for part in line.split("|")]
        if len(parts) != 5 or not parts[0]:
            continue
        name, partition, cpus, gres, state = parts
        nodes.append(NodeInfo(name=name, partition=partition.rstrip("*"), cpus=_count(cpus.rstrip("+")) or 0,
                              gpus=parse_gpus(gres), state=state))
    return nodes


# --- asking the cluster ---------------------------------------------------------------------------------------


def check_reachable() -> list[Finding]:
    """The client commands are on PATH and slurmctld answers ``scontrol ping``."""
    missing = [tool for tool in TOOLS if shutil.which(tool) is None]
    if missing:
        return [Finding("slurm", "error", f"{', '.join(missing)} not found on PATH",
                        "run doctor on a login node of the cluster (or load its Slurm module), or use a site with "
                        "[slurm] enabled = false")]
    ping = run_slurm(["scontrol", "ping"])
    if ping.returncode != 0 or " is UP" not in ping.stdout:
        states = [line.strip() for line in ping.stdout.splitlines() if line.startswith("Slurmctld(")]
        detail = "; ".join(states) or last_line(ping)  # "Slurmctld(primary) at host is DOWN", not its banner
        return [Finding("slurm", "error", f"the Slurm controller does not answer ({detail})",
                        "check 'scontrol ping' and SLURM_CONF; if slurmctld is down, ask the admins")]
    version = run_slurm(["sinfo", "--version"])
    about = last_line(ping) + (f"; {version.stdout.strip()}" if version.returncode == 0 else "")
    return [Finding("slurm", "ok", f"slurmctld answers: {about}")]


@dataclass(frozen=True)
class ClusterView:
    """Partitions and nodes as the cluster showed them, and any trouble reading them."""

    partitions: dict[str, Partition] = field(default_factory=dict)
    nodes: tuple[NodeInfo, ...] = ()
    findings: tuple[Finding, ...] = ()

    def members(self, partition: str) -> list[NodeInfo]:
        return [node for node in self.nodes if node.partition == partition]


def query_cluster() -> ClusterView:
    """One ``scontrol show partition`` and one ``sinfo --Node`` call."""
    shown = run_slurm(["scontrol", "show", "partition", "--oneliner"])
    if shown.returncode != 0:
        return ClusterView(findings=(Finding("partition", "error", f"scontrol show partition failed "
                                             f"({last_line(shown)})", "check 'scontrol show partition' by hand"),))
    listed = run_slurm(["sinfo", "--noheader", "--Node", f"--format={NODE_FORMAT}"])
    findings: tuple[Finding, ...] = ()
    if listed.returncode != 0:
        findings = (Finding("partition", "warning", f"sinfo failed ({last_line(listed)}): node CPUs, GPUs and "
                            "states not checked", "check 'sinfo --Node' by hand"),)
    return ClusterView(parse_partitions(shown.stdout), tuple(parse_nodes(listed.stdout)), findings)


# --- the rules ------------------------------------------------------------------------------------------------

_CONFIG_KEYS = {"partition": "job.partition", "nodes": "job.nodes", "time": "job.time",
                "tasks_per_node": "job.tasks_per_node", "cpus_per_task": "job.cpus_per_task",
                "gpus_per_node": "job.gpus_per_node"}
_PROBE_KEYS = {"partition": "the site's slurm.partition", "nodes": "--nodes", "time": "--probe-timeout",
               "tasks_per_node": "--ntasks-per-node", "cpus_per_task": "--ntasks-per-node",
               "gpus_per_node": "the site's node.gpus"}


@dataclass(frozen=True)
class JobShape:
    """What a job asks one partition for. Without a job config it is the probe's shape, and fixes name flags."""

    partition: str
    nodes: int
    tasks_per_node: int
    cpus_per_task: int = 1
    gpus_per_node: int = 0
    time: str = "00:05:00"
    from_config: bool = True

    @property
    def time_s(self) -> int:
        return parse_time_seconds(self.time) or 0

    def key(self, name: str) -> str:
        """What the user changes to fix ``name``: a config key, or a doctor flag."""
        return (_CONFIG_KEYS if self.from_config else _PROBE_KEYS)[name]

    def describe(self) -> str:
        gpus = f" x {self.gpus_per_node} GPUs" if self.gpus_per_node else ""
        return (f"{self.nodes} node{'s' if self.nodes != 1 else ''} x {self.tasks_per_node} task"
                f"{'s' if self.tasks_per_node != 1 else ''} x {self.cpus_per_task} CPU"
                f"{'s' if self.cpus_per_task != 1 else ''}{gpus}, {self.time}")


def choose_partition(shape: JobShape, partitions: Mapping[str, Partition]) -> Partition | Finding:
    """The partition the job names, else the cluster's default; a Finding when there is none."""
    names = ", ".join(sorted(partitions)) or "(none)"
    if not shape.partition:
        default = next((p for p in partitions.values() if p.default), None)
        if default is not None:
            return default
        return Finding("partition", "error", "no partition is set and the cluster has no default partition",
                       f"set {shape.key('partition')} to one of: {names}")
    found = partitions.get(shape.partition)
    if found is not None:
        return found
    hint = did_you_mean(shape.partition, partitions)
    problem = f'partition "{shape.partition}" does not exist' + (f", {hint}" if hint else "")
    return Finding("partition", "error", problem, f"set {shape.key('partition')} to one of: {names}")


def _node_limits(shape: JobShape, part: Partition, members: list[NodeInfo]) -> list[Finding]:
    """Enough nodes with enough CPUs and GPUs, and enough of those up."""
    label, key = f'partition "{part.name}"', shape.key
    need_cpus = shape.tasks_per_node * shape.cpus_per_task
    cpu_cap = max((n.cpus for n in members), default=0)
    if part.max_cpus_per_node is not None:
        cpu_cap = min(cpu_cap, part.max_cpus_per_node)
    if need_cpus > cpu_cap:
        return [Finding("partition", "error", f"{key('tasks_per_node')} x {key('cpus_per_task')} = "
                        f"{shape.tasks_per_node} x {shape.cpus_per_task} = {need_cpus} CPUs per node, but the nodes "
                        f"of {label} have at most {cpu_cap}",
                        f"lower {key('tasks_per_node')} x {key('cpus_per_task')} to <= {cpu_cap}, or choose another "
                        "partition")]
    gpu_cap = max((n.gpus for n in members), default=0)
    if shape.gpus_per_node > gpu_cap:
        have = f"at most {gpu_cap} GPUs (gres)" if gpu_cap else "no GPUs (gres gpu)"
        fix = (f"lower {key('gpus_per_node')} to <= {gpu_cap}, or choose another partition" if gpu_cap else
               f"choose a GPU partition ({key('partition')})")
        return [Finding("partition", "error", f"{key('gpus_per_node')} = {shape.gpus_per_node}, but the nodes of "
                        f"{label} have {have}", fix)]
    fit = [n for n in members if n.cpus >= need_cpus and n.gpus >= shape.gpus_per_node]
    if len(fit) < shape.nodes:
        gpus = f" and {shape.gpus_per_node} GPUs" if shape.gpus_per_node else ""
        return [Finding("partition", "error", f"only {len(fit)} node{'s' if len(fit) != 1 else ''} of {label} have "
                        f"{need_cpus} CPUs{gpus}, the job asks for {shape.nodes}",
                        f"set {key('nodes')} <= {len(fit)}, or choose another partition")]
    usable = [n for n in fit if n.usable]
    if len(usable) < shape.nodes:
        states = ", ".join(sorted({f"{n.name} {n.state}" for n in fit if not n.usable}))
        return [Finding("partition", "warning", f"only {len(usable)} of the {len(fit)} nodes of {label} that fit are "
                        f"up ({states}); the job waits until {shape.nodes} are", "wait, or choose another partition "
                        f"({key('partition')}), or lower {key('nodes')}")]
    return []


def check_partition(shape: JobShape, view: ClusterView) -> list[Finding]:
    """The partition exists and is UP, and its time, node, CPU and GPU limits admit the job."""
    chosen = choose_partition(shape, view.partitions)
    if isinstance(chosen, Finding):
        return [chosen]
    part, key, label = chosen, shape.key, f'partition "{chosen.name}"'
    findings = []
    if part.state != "UP":
        findings.append(Finding("partition", "error", f"{label} is {part.state}: no job starts there",
                                f"choose another partition ({key('partition')}), or ask the admins when it is back"))
    if part.max_time_s is not None and shape.time_s > part.max_time_s:
        findings.append(Finding("partition", "error", f"{key('time')} = {shape.time} is longer than the MaxTime "
                                f"{part.max_time} of {label}",
                                f"set {key('time')} <= {part.max_time}, or choose another partition"))
    members = view.members(part.name)
    total = len(members) or part.total_nodes
    if part.max_nodes is not None and shape.nodes > part.max_nodes:
        findings.append(Finding("partition", "error", f"{key('nodes')} = {shape.nodes}, but {label} allows at most "
                                f"{part.max_nodes} nodes per job (MaxNodes)",
                                f"set {key('nodes')} <= {part.max_nodes}, or choose another partition"))
    elif shape.nodes > total:
        findings.append(Finding("partition", "error", f"{key('nodes')} = {shape.nodes}, but {label} has {total} "
                                f"node{'s' if total != 1 else ''}",
                                f"set {key('nodes')} <= {total}, or choose another partition"))
    elif members:
        findings += _node_limits(shape, part, members)
    if not findings:
        cpus = sorted({n.cpus for n in members})
        shape_text = f"{total} nodes" + (f" of {'/'.join(map(str, cpus))} CPUs" if cpus else "")
        who = "the job" if shape.from_config else "the probe job"
        findings.append(Finding("partition", "ok", f"{label} is UP ({shape_text}, MaxTime {part.max_time}); {who} "
                                f"fits: {shape.describe()}"))
    return findings


def check_site(site: SiteConfig, part: Partition, members: Iterable[NodeInfo]) -> list[Finding]:
    """The site file's picture of the partition (max_time, node CPUs and GPUs) against what Slurm says."""
    findings = []
    where = f"site {site.name}"
    site_max = parse_time_seconds(site.slurm.max_time) if site.slurm.max_time else None
    if site_max is not None and part.max_time_s is not None and site_max > part.max_time_s:
        findings.append(Finding("site", "warning", f"{where} says slurm.max_time = {site.slurm.max_time}, but "
                                f'partition "{part.name}" allows {part.max_time}: longer jobs pass validation and '
                                "then wait forever", f"set slurm.max_time = \"{part.max_time}\" in the site file"))
    nodes = list(members)
    if nodes:
        cpus = max(n.cpus for n in nodes)
        gpus = max(n.gpus for n in nodes)
        if site.node.cpus > cpus:
            findings.append(Finding("site", "warning", f"{where} says node.cpus = {site.node.cpus}, but the nodes of "
                                    f'partition "{part.name}" have at most {cpus}: jobs sized from the site do not fit',
                                    f"set node.cpus = {cpus} in the site file"))
        if site.node.gpus > gpus:
            findings.append(Finding("site", "warning", f"{where} says node.gpus = {site.node.gpus}, but the nodes of "
                                    f'partition "{part.name}" have at most {gpus} (gres)',
                                    f"set node.gpus = {gpus} in the site file, or check the partition"))
    return findings
