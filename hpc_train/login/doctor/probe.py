"""The signal-delivery probe: a tiny real job is sent the preemption signal, and every rank must report it.

Why a real job: a preemption that never reaches the ranks (a wrapper that eats the signal, a site that sends
it only to the batch shell) is found out today only when a week of training is lost. The probe also proves
the run folder's root is the same folder on every node: doctor writes a random token there before submitting,
and every task reads it back into its report. Reports are files (``ready-<rank>.json``, ``signal-<rank>.json``)
in ``RUN_ROOT/.doctor/<random>/`` (mode 0700), written by :mod:`hpc_train.login.doctor.probe_task`.

Sequence: sbatch --parsable; wait for every ready file (or the job's end, or ``--probe-timeout``);
``scancel --signal=SIG JOB`` (no ``--batch``: the signal goes to the job steps, i.e. the ranks, as the
``--signal`` directive of a real job does); wait for every signal file; ``scancel JOB`` in any case.
"""

from __future__ import annotations

import json
import os
import secrets
import shlex
import shutil
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hpc_train.config.checks import (
    check_constraint,
    check_hostlist,
    check_module,
    check_path,
    check_signal,
    check_slurm_name,
    check_srun_arg,
)
from hpc_train.errors import ConfigError
from hpc_train.login.doctor.findings import Finding
from hpc_train.login.doctor.slurm_checks import last_line, parse_oneliner, run_slurm

__all__ = ["PROBE_FOLDER", "ProbeOutcome", "ProbeRequest", "make_probe_folder", "probe_script", "run_probe"]

PROBE_FOLDER = ".doctor"
SIGNAL_WAIT_S = 30.0
_POLL_S = 0.2
_STATE_POLL_S = 2.0
_ENDED_GRACE_S = 2.0
_ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE",
          "PREEMPTED", "GONE")


@dataclass(frozen=True)
class ProbeRequest:
    """The probe job; every value reaches an ``#SBATCH`` line or a shell word, so all are checked first."""

    nodes: int
    tasks_per_node: int
    signal: str
    run_root: str
    python: str
    name: str = "hpc_train-doctor"
    partition: str = ""
    account: str = ""
    qos: str = ""
    constraint: str = ""
    exclude: str = ""
    srun_args: tuple[str, ...] = ()
    modules: tuple[str, ...] = ()
    time_minutes: int = 5
    code_path: str = ""  # a user program's file (or its code folder), which every rank must see too

    @property
    def world(self) -> int:
        return self.nodes * self.tasks_per_node

    @property
    def signal_name(self) -> str:
        return self.signal.upper().removeprefix("SIG")

    def validate(self) -> None:
        """ConfigError (exit 2) for any value that could break out of its line in the batch script."""
        checks = [("job.name", self.name, check_slurm_name), ("job.partition", self.partition, check_slurm_name),
                  ("job.account", self.account, check_slurm_name), ("job.qos", self.qos, check_slurm_name),
                  ("job.constraint", self.constraint, check_constraint), ("job.exclude", self.exclude, check_hostlist),
                  ("job.run_root", self.run_root, check_path), ("software.python", self.python, check_path),
                  ("preempt.signal", self.signal, check_signal)]
        checks += [("launch.srun_args", arg, check_srun_arg) for arg in self.srun_args]
        checks += [("software.modules", module, check_module) for module in self.modules]
        for where, value, check in checks:
            bad = check(value)
            if bad:
                raise ConfigError(where, bad[0], bad[1])
        if not self.name:
            raise ConfigError("job.name", "is empty", "give the probe job a name")
        if not os.path.isabs(self.run_root):
            raise ConfigError("job.run_root", f"{self.run_root!r} is not absolute", "give an absolute path")
        if self.code_path:
            bad = check_path(self.code_path)
            if bad:
                raise ConfigError("job.program", f"its path {bad[0]}", "keep the program's path to letters, digits "
                                  "and ./_+@,:=- so that doctor can probe it")
        for where, count in (("--nodes", self.nodes), ("--ntasks-per-node", self.tasks_per_node),
                             ("probe time", self.time_minutes)):
            if count < 1:
                raise ConfigError(where, f"{count} is below the minimum 1", "give 1 or more")


def probe_script(request: ProbeRequest, folder: Path) -> str:
    """The batch script: validated values only, each shell word quoted."""
    request.validate()
    bad = check_path(str(folder))
    if bad:
        raise ConfigError("job.run_root", f"the probe folder {bad[0]}", bad[1])
    directives = [f"--job-name={request.name}", f"--nodes={request.nodes}",
                  f"--ntasks-per-node={request.tasks_per_node}", "--cpus-per-task=1",
                  f"--time={request.time_minutes}", f"--output={folder}/probe-%j.out", f"--chdir={folder}"]
    for flag, value in (("partition", request.partition), ("account", request.account), ("qos", request.qos),
                        ("constraint", request.constraint), ("exclude", request.exclude)):
        if value:
            directives.append(f"--{flag}={value}")
    sig = request.signal_name
    command = ["srun", "--kill-on-bad-exit=0", *request.srun_args, request.python, "-m",
               "hpc_train.login.doctor.probe_task", str(folder), sig,
               *([request.code_path] if request.code_path else [])]
    lines = ["#!/bin/bash -l" if request.modules else "#!/bin/bash",
             *(f"#SBATCH {line}" for line in directives),
             "# hpc_train doctor: the signal-delivery probe. Every task reports ready, then waits for "
             f"SIG{sig}.", "set -eo pipefail"]
    lines += [f"module load {shlex.quote(module)}" for module in request.modules]
    lines += ["# The signal is sent to the job steps (scancel --signal, no --batch); should a site also deliver it",
              "# to this shell, the trap keeps the shell alive until the tasks have reported it.",
              f"trap 'echo \"hpc_train doctor probe: the batch shell got SIG{sig}\" >&2' {sig}",
              " ".join(shlex.quote(word) for word in command), ""]
    return "\n".join(lines)


def make_probe_folder(run_root: Path) -> Path:
    """``RUN_ROOT/.doctor/<random>``, private (0700) and new: no earlier probe's reports can pass for this one's."""
    old_umask = os.umask(0o077)
    try:
        base = run_root / PROBE_FOLDER
        base.mkdir(parents=True, exist_ok=True)
        os.chmod(base, 0o700)
        folder = base / secrets.token_hex(6)
        folder.mkdir(mode=0o700)
    finally:
        os.umask(old_umask)
    return folder


@dataclass
class ProbeOutcome:
    """Findings (probe, run folder) and what each rank reported, for ``--json``."""

    findings: list[Finding] = field(default_factory=list)
    job_id: str = ""
    folder: str = ""
    ranks: list[dict[str, Any]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"job_id": self.job_id, "folder": self.folder, "ranks": self.ranks}


def _reports(folder: Path, kind: str, ranks: Iterable[int]) -> dict[int, dict[str, Any]]:
    """The ``kind`` reports of ``ranks`` that exist. Each file is opened by name, never found by listing the
    folder: on NFS an open revalidates, where a directory listing may be cached for a minute."""
    found: dict[int, dict[str, Any]] = {}
    for rank in ranks:
        try:
            data = json.loads((folder / f"{kind}-{rank}.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if isinstance(data, dict) and data.get("rank") == rank:
            found[rank] = data
    return found


def _collect(folder: Path, kind: str, world: int, found: dict[int, dict[str, Any]]) -> bool:
    """Add the reports not yet seen to ``found``; True once every rank has one."""
    found.update(_reports(folder, kind, (rank for rank in range(world) if rank not in found)))
    return len(found) >= world


def _job_state(job_id: str) -> dict[str, str]:
    """JobState, Reason and NodeList from ``scontrol show job``; JobState GONE once Slurm forgot the job."""
    shown = run_slurm(["scontrol", "show", "job", job_id, "--oneliner"])
    if shown.returncode != 0:
        return {"JobState": "GONE" if "invalid job id" in shown.stderr.lower() else "UNKNOWN"}
    return parse_oneliner(shown.stdout.strip().splitlines()[0] if shown.stdout.strip() else "")


def _node_of(rank: int, request: ProbeRequest, state: Mapping[str, str], seen: Mapping[int, dict[str, Any]]) -> str:
    """The node a rank reported from, else the one block distribution puts it on (rank // tasks per node)."""
    if rank in seen:
        return str(seen[rank].get("node", "?"))
    from hpc_train.common.hostlist import expand

    try:
        hosts = expand(state.get("NodeList", ""))
    except ValueError:
        hosts = []
    index = rank // request.tasks_per_node
    return hosts[index] if index < len(hosts) else "an unknown node"


def _ranks(ranks: list[int]) -> str:
    """``rank 3``, ``ranks 0-7``, ``ranks 1, 5, 9``: ranks named in one finding per node."""
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    if ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"ranks {ranks[0]}-{ranks[-1]}"
    shown = ", ".join(map(str, ranks[:8]))
    return f"ranks {shown}" + (f" and {len(ranks) - 8} more" if len(ranks) > 8 else "")


def _by_node(missing: list[int], request: ProbeRequest, state: Mapping[str, str],
             seen: Mapping[int, dict[str, Any]]) -> dict[str, list[int]]:
    """Missing ranks grouped by the node they ran (or would run) on, in rank order."""
    nodes: dict[str, list[int]] = {}
    for rank in missing:
        nodes.setdefault(_node_of(rank, request, state, seen), []).append(rank)
    return nodes


def _output_tail(folder: Path, job_id: str, lines: int = 4) -> str:
    try:
        text = (folder / f"probe-{job_id}.out").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ""
    tail = [line for line in text.splitlines() if line.strip()][-lines:]
    return " | ".join(tail)


def _wait(until: Callable[[], bool], deadline: float, job_id: str) -> dict[str, str]:
    """Poll ``until`` until it holds or the deadline passes; a job that ended gets a short grace for its last
    reports to become visible. Returns the job's last known state."""
    state: dict[str, str] = {}
    next_state = 0.0
    while not until() and time.monotonic() < deadline:
        if time.monotonic() >= next_state:
            state = _job_state(job_id)
            next_state = time.monotonic() + _STATE_POLL_S
            if state.get("JobState", "") in _ENDED:
                deadline = min(deadline, time.monotonic() + _ENDED_GRACE_S)
                next_state = deadline  # it will not come back
        time.sleep(_POLL_S)
    return state or _job_state(job_id)


class _Probe:
    """One probe run; a class only to share the request, folder and job id between its phases."""

    def __init__(self, request: ProbeRequest, folder: Path, token: str, job_id: str, run_root: Path) -> None:
        self.request, self.folder, self.token, self.job_id, self.run_root = request, folder, token, job_id, run_root
        self.findings: list[Finding] = []

    def not_ready(self, ready: dict[int, dict[str, Any]], state: dict[str, str], timeout_s: float) -> None:
        """Some ranks never reported ready: why, as far as the job's state tells."""
        job_state, reason = state.get("JobState", "UNKNOWN"), state.get("Reason", "")
        tail = _output_tail(self.folder, self.job_id)
        out = f"{self.folder}/probe-{self.job_id}.out"
        if job_state == "PENDING":
            self.findings.append(Finding("probe", "error", f"probe job {self.job_id} did not start within "
                                         f"{timeout_s:.0f} s (PENDING, Reason={reason or '?'})",
                                         "run doctor when the partition has free nodes, raise --probe-timeout, or "
                                         "skip the probe with --no-probe"))
            return
        if job_state in _ENDED:
            if ready:
                what = f"{self.request.world - len(ready)} of {self.request.world} ranks reported"
            else:
                what = (f"any rank reported: the run folder root {self.run_root} may not be shared with the compute "
                        "nodes, or hpc_train cannot start there")
            self.findings.append(Finding("probe", "error", f"probe job {self.job_id} ended ({job_state}) before "
                                         f"{what}" + (f"; job output: {tail}" if tail else ""),
                                         f"read {out} (on the first node if the folder is not shared); is hpc_train "
                                         f"installed for {self.request.python} on the compute nodes?"))
            return
        missing = [rank for rank in range(self.request.world) if rank not in ready]
        for node, ranks in _by_node(missing, self.request, state, ready).items():
            self.findings.append(Finding("run folder", "error", f"run folder root {self.run_root} is not shared "
                                         f"with node {node}: {_ranks(ranks)} never reported in {self.folder} within "
                                         f"{timeout_s:.0f} s (job {job_state})" + (f"; job output: {tail}" if tail
                                                                                    else ""),
                                         "set job.run_root (or the site's run_root) to a file system every node "
                                         f"mounts; if it is shared, read {out}"))

    def tokens(self, ready: dict[int, dict[str, Any]]) -> None:
        """Each rank read back doctor's token: the folder is the same folder on its node."""
        wrong = {rank: data for rank, data in sorted(ready.items()) if data.get("token") != self.token}
        for rank, data in wrong.items():
            seen = "could not read it" if data.get("token") is None else "read a different token"
            self.findings.append(Finding("run folder", "error", f"run folder root {self.run_root} is not shared "
                                         f"with node {data.get('node', '?')}: rank {rank} {seen} in {self.folder}",
                                         "set job.run_root (or the site's run_root) to a file system every node "
                                         "mounts, the same path everywhere"))
        if not wrong:
            nodes = sorted({str(data.get("node", "?")) for data in ready.values()})
            self.findings.append(Finding("run folder", "ok", f"run folder root {self.run_root} is shared: every "
                                         f"rank on {', '.join(nodes)} read doctor's token back"))

    def code(self, ready: dict[int, dict[str, Any]]) -> None:
        """Each rank looked for the user program's file: compute nodes must see it, as they see the run folder."""
        path = self.request.code_path
        if not path:
            return
        blind = sorted({str(data.get("node", "?")) for data in ready.values() if data.get("code_seen") is False})
        if blind:
            self.findings.append(Finding("code folder", "error", f"the program {path} is not visible on "
                                         f"{', '.join(blind)}", "put the code on a file system every node mounts "
                                         "(the same path everywhere), next to the run folder"))
        else:
            nodes = sorted({str(data.get("node", "?")) for data in ready.values()})
            self.findings.append(Finding("code folder", "ok", f"the program {path} is visible on {', '.join(nodes)}"))

    def signal(self, ready: dict[int, dict[str, Any]]) -> dict[int, dict[str, Any]]:
        """Send the signal to the job steps and wait for every rank's report of it."""
        sig = self.request.signal_name
        sent_at = time.time()
        sent = run_slurm(["scancel", f"--signal={sig}", self.job_id])
        if sent.returncode != 0:
            self.findings.append(Finding("probe", "error", f"scancel --signal={sig} {self.job_id} failed "
                                         f"({last_line(sent)})", "check that scancel works for your jobs"))
            return {}
        got: dict[int, dict[str, Any]] = {}
        world = self.request.world
        state = _wait(lambda: _collect(self.folder, "signal", world, got), time.monotonic() + SIGNAL_WAIT_S,
                      self.job_id)
        _collect(self.folder, "signal", world, got)
        missing = [rank for rank in range(self.request.world) if rank not in got]
        for node, ranks in _by_node(missing, self.request, state, ready).items():
            self.findings.append(Finding("probe", "error", f"{_ranks(ranks)} on {node} did not get SIG{sig} within "
                                         f"{SIGNAL_WAIT_S:.0f} s of scancel --signal",
                                         "the probe's tasks are plain srun tasks, so look at the node side: a "
                                         "task prolog or SPANK plugin that blocks the signal, a slurmd that "
                                         f"cannot reach the tasks; see {self.folder}/probe-{self.job_id}.out"))
        if not missing:
            nodes = sorted({str(data.get("node", "?")) for data in got.values()})
            slowest = max(float(data.get("received", sent_at)) for data in got.values()) - sent_at
            self.findings.append(Finding("probe", "ok", f"SIG{sig} reached all {self.request.world} rank"
                                         f"{'s' if self.request.world != 1 else ''} on {', '.join(nodes)} "
                                         f"(job {self.job_id}, slowest {max(slowest, 0.0):.2f} s after scancel)"))
        return got


# Set by the user, not by a job: which slurm.conf and which clusters the Slurm commands talk to.
_KEEP = frozenset({"SLURM_CONF", "SLURM_CLUSTERS"})


def _submit_env(environ: Mapping[str, str]) -> dict[str, str]:
    """``environ`` without the SLURM_*/SRUN_* variables of a job doctor may itself run in: the probe job would
    inherit them (sbatch exports the environment) and its srun would read the outer job's geometry."""
    return {k: v for k, v in environ.items() if k in _KEEP or not k.startswith(("SLURM_", "SRUN_"))}


def run_probe(request: ProbeRequest, timeout_s: float) -> ProbeOutcome:
    """Submit the probe, signal it, collect every rank's reports; the job is always cancelled at the end."""
    request.validate()
    run_root = Path(request.run_root)
    outcome = ProbeOutcome()
    try:
        folder = make_probe_folder(run_root)
        token = secrets.token_hex(16)
        (folder / "token").write_text(token + "\n", encoding="utf-8")
        script = folder / "probe.sbatch"
        script.write_text(probe_script(request, folder), encoding="utf-8")
    except OSError as error:
        outcome.findings.append(Finding("run folder", "error", f"cannot write the probe folder under {run_root} "
                                        f"({error.strerror or error})", "pick a job.run_root you can write to"))
        return outcome
    outcome.folder = str(folder)
    submitted = run_slurm(["sbatch", "--parsable", str(script)], env=_submit_env(os.environ))
    job_id = submitted.stdout.strip().split(";")[0]
    if submitted.returncode != 0 or not (job_id.isascii() and job_id.isdigit()):
        outcome.findings.append(Finding("probe", "error", f"sbatch refused the probe job ({last_line(submitted)})",
                                        "check the partition, account and QoS (job.partition, job.account, job.qos "
                                        f"or the site's); the script is {script}"))
        return outcome
    outcome.job_id = job_id
    probe = _Probe(request, folder, token, job_id, run_root)
    ready: dict[int, dict[str, Any]] = {}
    signalled: dict[int, dict[str, Any]] = {}
    try:
        state = _wait(lambda: _collect(folder, "ready", request.world, ready), time.monotonic() + timeout_s, job_id)
        if not _collect(folder, "ready", request.world, ready):
            probe.not_ready(ready, state, timeout_s)
        else:
            probe.tokens(ready)
            probe.code(ready)
            signalled = probe.signal(ready)
    finally:
        run_slurm(["scancel", job_id])
    outcome.ranks = [{"rank": rank, "node": data.get("node"), "hostname": data.get("hostname"),
                      "token_ok": data.get("token") == token, "signal": rank in signalled}
                     for rank, data in sorted(ready.items())]
    outcome.findings = probe.findings
    if not any(f.is_error for f in outcome.findings):
        shutil.rmtree(folder, ignore_errors=True)  # kept when something failed: its files say why
        outcome.folder = ""
    return outcome
