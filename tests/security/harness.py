"""The harness of the hostile-input corpus: one private world per case, the command run in this process, and the
checks every case shares.

Why: a hostile value is only dealt with when the whole chain holds (the exit status, one message, nothing written
outside the run folder, no rendered or submitted script that runs it, no secret on disk, a quick answer), so each
case states only its input and what it expects, and these checks are the same for all of them. In-process, the
corpus takes seconds; the few inputs that could block (a FIFO, /dev/zero, a sweep of 10,000 runs) go to a
subprocess with a timeout.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import re
import resource
import shutil
import stat
import subprocess
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import rich.console
import submitit

import hpc_train.login.ckpt_cli
import hpc_train.login.ops.status
import hpc_train.login.slurm.render
from hpc_train.login import main as hpc_main
from hpc_train.login import submit as hpc_submit
from tests.conftest import PYTHON, chdir

__all__ = ["Case", "Outcome", "World", "cases_ids", "make_stubs", "make_world", "run_case"]

# Imported once here so that a case's 2 s budget measures the command, not the first import of rich or submitit.
_ = (hpc_train.login.ckpt_cli, hpc_train.login.ops.status, hpc_train.login.slurm.render, rich.console, submitit)
LIMIT_S = 2.0
SCRIPT_TIMEOUT_S = 10
JOB_NAME = "hpc-train"
# Stubs of the Slurm and MPI tools: they exit 0 and never run their arguments (a bash shebang, so that a
# BASH_ENV the script exported would be read by them and show on the canary).
_STUBS = {
    "srun": "exit 0", "mpirun": "exit 0", "torchrun": "exit 0", "squeue": "exit 0", "sacct": "exit 0",
    "scancel": "exit 0", "module": "exit 0",
    "scontrol": 'case "$1" in show) echo n1 ;; ping) echo "Slurmctld(primary) at stub is UP" ;; esac\nexit 0',
}
# sbatch copies the script it is given into the case's capture folder (or refuses, when the case says so).
_SBATCH = """here="$HPC_SECURITY_WORLD/.harness"
if [ -e "$here/sbatch-refuses" ]; then
  echo "sbatch: error: Batch job submission failed: Invalid account or account/partition combination" >&2
  exit 1
fi
last=""
for arg in "$@"; do last="$arg"; done
n=$(ls "$here/captured" | wc -l)
cp -- "$last" "$here/captured/script-$n.sh"
echo "Submitted batch job 4242"
"""


@dataclass(frozen=True)
class World:
    """The tmp tree of one case. ``.harness`` (what the sbatch stub was given, printed scripts) is outside what the
    snapshot compares; the stub tools themselves live outside the tree, shared by all cases."""

    root: Path
    bin: Path  # the stub tools, shared by every case (make_stubs)

    work = property(lambda self: self.root / "work")  # the working folder and the job file
    runs = property(lambda self: self.root / "runs")  # job.run_root of every job file
    run_dir = property(lambda self: self.runs / JOB_NAME)
    home = property(lambda self: self.root / "home")
    tmp = property(lambda self: self.root / "tmp")  # TMPDIR: a crash log or temporary file shows in the snapshot
    victim = property(lambda self: self.root / "victim")  # a folder planted links point at
    victim_file = property(lambda self: self.root / "victim" / "precious.txt")
    payload = property(lambda self: self.root / "payload.sh")  # a file that creates the canary when sourced
    canary = property(lambda self: self.root / "canary")
    harness = property(lambda self: self.root / ".harness")
    stubs = property(lambda self: self.bin / "bin")
    script_stubs = property(lambda self: self.bin / "bin-script")  # python and python3, for scripts only
    captured = property(lambda self: self.root / ".harness" / "captured")
    refuse_flag = property(lambda self: self.root / ".harness" / "sbatch-refuses")

    def sub(self, text: str) -> str:
        """Put this world's paths into a case's text (``@CANARY@``, ``@RUN@``, ...)."""
        if "@" not in text:
            return text
        for token, path in (("@JOB@", self.work / "job.toml"), ("@SITE@", self.work / "site.toml"),
                            ("@RUNS@", self.runs), ("@RUN@", self.run_dir), ("@WORK@", self.work),
                            ("@CANARY@", self.canary), ("@VICTIM@", self.victim), ("@PAYLOAD@", self.payload),
                            ("@HOME@", self.home), ("@ROOT@", self.root)):
            if token in text:
                text = text.replace(token, str(path))
        return text


def _stub(path: Path, body: str) -> None:
    path.write_text(f"#!/bin/bash\n{body}\n", encoding="utf-8")
    path.chmod(0o755)


def make_stubs(folder: Path) -> None:
    """The stub tools under ``folder``: bin/ (Slurm and MPI, first on PATH) and bin-script/ (python, python3)."""
    (folder / "bin").mkdir(parents=True)
    (folder / "bin-script").mkdir()
    for name, body in {**_STUBS, "sbatch": _SBATCH}.items():
        _stub(folder / "bin" / name, body)
    for name in ("python", "python3"):
        _stub(folder / "bin-script" / name, "exit 0")


def make_world(root: Path, stubs: Path) -> World:
    """The tree of one case; ``stubs`` is the folder :func:`make_stubs` filled. The sbatch stub finds the case's
    capture folder through $HPC_SECURITY_WORLD, which the fixture sets."""
    world = World(root, stubs)
    for folder in (world.work, world.runs, world.home, world.tmp, world.victim, world.captured):
        folder.mkdir(parents=True, exist_ok=True)
    world.victim_file.write_text("the bytes a planted link must never change\n", encoding="utf-8")
    (world.victim / "notes.txt").write_text("victim folder\n", encoding="utf-8")
    world.payload.write_text(f"touch {world.canary}\n", encoding="utf-8")
    return world


Check = Callable[["World", "Outcome"], None]


@dataclass(frozen=True)
class Case:
    """One hostile input: the command line (``@JOB@`` ... filled in by :meth:`World.sub`), the files it reads, and
    what must happen."""

    id: str
    argv: tuple[str, ...]
    job: str | None = ""  # TOML of @JOB@ (job.run_root = @RUNS@ is added); None: no job file
    entry: str = "main"  # "main": python -m hpc_train; "submit": python -m hpc_train.submit
    expect: tuple[int, ...] = (2,)
    says: tuple[str, ...] = ()  # texts the one error line must hold (exit 2)
    warns: tuple[str, ...] = ()  # regular expressions a stderr line must match (exit 0)
    shows: tuple[str, ...] = ()  # texts stdout must hold (exit 0)
    site: str | None = None  # TOML of @SITE@
    leak: str = ""  # a secret value that must be in no file under the world afterwards
    setup: Callable[[World], None] | None = None
    check: Check | None = None
    refuse_sbatch: bool = False
    isolated: bool = False  # run in a subprocess (timeout 10 s): inputs that could block
    allowed: tuple[str, ...] = ()  # more paths (relative to the world) a successful command may write
    no_escapes: bool = False  # ESC / CSI bytes must not reach the terminal


@dataclass
class Outcome:
    code: int
    out: str
    err: str
    seconds: float
    problems: list[str] = field(default_factory=list)


def cases_ids(cases: list[Case]) -> list[str]:
    return [case.id for case in cases]


def _with_run_root(text: str, world: World) -> str:
    if "run_root" in text:
        return text
    line = f'run_root = "{world.runs}"'
    if re.search(r"^\[job\][ \t]*$", text, re.M):
        return re.sub(r"^\[job\][ \t]*$", lambda m: f"{m[0]}\n{line}", text, count=1, flags=re.M)
    return f"{text}\n[job]\n{line}\n"


def _prepare(case: Case, world: World) -> list[str]:
    if case.job is not None:
        (world.work / "job.toml").write_text(_with_run_root(world.sub(case.job), world), encoding="utf-8")
    if case.site is not None:
        (world.work / "site.toml").write_text(world.sub(case.site), encoding="utf-8")
    if case.refuse_sbatch:
        world.refuse_flag.touch()
    if case.setup is not None:
        case.setup(world)
    return [world.sub(arg) for arg in case.argv]


def _in_process(case: Case, argv: list[str], world: World) -> Outcome:
    entry = hpc_submit.main if case.entry == "submit" else hpc_main.main
    out, err = io.StringIO(), io.StringIO()
    saved_env, umask = dict(os.environ), os.umask(0o022)
    os.umask(umask)
    escaped = ""
    start = time.monotonic()
    try:
        with chdir(world.work), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = entry(argv)
            except SystemExit as exit_:
                code = exit_.code if isinstance(exit_.code, int) else 1
    except BaseException as error:  # what the command let escape is the finding
        code = -1
        last = traceback.extract_tb(error.__traceback__)[-1]
        escaped = f"{type(error).__name__} escaped: {str(error)[:200]!r} at {last.filename}:{last.lineno} {last.name}"
    finally:
        seconds = time.monotonic() - start
        os.environ.clear()
        os.environ.update(saved_env)
        os.umask(umask)
    outcome = Outcome(code, out.getvalue(), err.getvalue(), seconds)
    if escaped:
        outcome.problems.append(escaped)
    return outcome


def _limit_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))


def _isolated(case: Case, argv: list[str], world: World) -> Outcome:
    module = "hpc_train.submit" if case.entry == "submit" else "hpc_train"
    start = time.monotonic()
    try:
        done = subprocess.run([PYTHON, "-m", module, *argv], cwd=world.work, capture_output=True, text=True,
                              errors="replace", timeout=SCRIPT_TIMEOUT_S, check=False, preexec_fn=_limit_memory)
    except subprocess.TimeoutExpired as error:
        text = (error.stderr or b"").decode(errors="replace") if isinstance(error.stderr, bytes) else ""
        outcome = Outcome(-9, "", text, time.monotonic() - start)
        outcome.problems.append(f"no answer within {SCRIPT_TIMEOUT_S} s (killed)")
        return outcome
    return Outcome(done.returncode, done.stdout, done.stderr, time.monotonic() - start)


# -- the tree ------------------------------------------------------------------------------------------------

Snapshot = dict[str, tuple[object, ...]]


def _digest(path: Path) -> str:
    with open(path, "rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()


def snapshot(world: World) -> Snapshot:
    """Every path under the world but ``.harness``: its type, mode, and a link's target or a file's sha256."""
    found: Snapshot = {}
    pending = [world.root]
    while pending:
        for entry in os.scandir(pending.pop()):
            path = Path(entry.path)
            if path == world.harness:
                continue
            info = os.lstat(path)
            rel, mode = path.relative_to(world.root).as_posix(), stat.S_IMODE(info.st_mode)
            if stat.S_ISLNK(info.st_mode):
                found[rel] = ("link", os.readlink(path))
            elif stat.S_ISDIR(info.st_mode):
                found[rel] = ("dir", mode)
                pending.append(path)
            elif stat.S_ISREG(info.st_mode):
                found[rel] = ("file", mode, _digest(path))
            else:
                found[rel] = ("special", stat.S_IFMT(info.st_mode), mode)
    return found


def _under(rel: str, prefixes: list[str]) -> bool:
    return any(rel == prefix or rel.startswith(prefix + "/") for prefix in prefixes)


def changed_paths(before: Snapshot, after: Snapshot) -> list[str]:
    return sorted(rel for rel in set(before) | set(after) if before.get(rel) != after.get(rel))


def _check_tree(case: Case, world: World, outcome: Outcome, before: Snapshot, after: Snapshot) -> None:
    changed = changed_paths(before, after)
    if outcome.code != 0:
        if changed:
            outcome.problems.append(f"exit {outcome.code} but the tree changed: {_describe(changed, before, after)}")
        return
    allowed = [world.run_dir.relative_to(world.root).as_posix(), *(world.sub(p) for p in case.allowed)]
    outside = [rel for rel in changed if not _under(rel, allowed)]
    if outside:
        outcome.problems.append(f"wrote outside the run folder: {_describe(outside, before, after)}")


def _describe(paths: list[str], before: Snapshot, after: Snapshot) -> str:
    shown = [f"{rel} ({_kind(before.get(rel))} -> {_kind(after.get(rel))})" for rel in paths[:4]]
    return ", ".join(shown) + (f" and {len(paths) - 4} more" if len(paths) > 4 else "")


def _kind(entry: tuple[object, ...] | None) -> str:
    if entry is None:
        return "absent"
    return f"{entry[0]} {oct(entry[1])}" if isinstance(entry[1], int) else f"{entry[0]} {entry[1]}"


# -- what was said --------------------------------------------------------------------------------------------


def _check_messages(case: Case, outcome: Outcome) -> None:
    out, err, code = outcome.out, outcome.err, outcome.code
    if code not in case.expect:
        outcome.problems.append(f"exit {code}, expected {' or '.join(map(str, case.expect))} "
                                f"(stderr: {_excerpt(err)}; stdout: {_excerpt(out)})")
    if "Traceback" in out + err:
        where = err if "Traceback" in err else out
        outcome.problems.append(f"a Traceback: {_excerpt(where[where.index('Traceback'):], 300)}")
    if re.search(r"unexpected failure|internal error", err, re.I):
        outcome.problems.append(f"crashed into the catch-all handler: {_excerpt(err, 200)}")
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    if code == 2 and len(errors) != 1:
        outcome.problems.append(f"{len(errors)} lines start with 'error:' on stderr, expected one")
    if code == 0 and errors:
        outcome.problems.append(f"exit 0 but stderr says {_excerpt(errors[0])}")
    if code == 1 and not (out + err).strip():
        outcome.problems.append("exit 1 without a word")
    if code == 2 and errors:
        missing = [text for text in case.says if text not in errors[0]]
        if missing:
            outcome.problems.append(f"the message does not name {missing}: {_excerpt(errors[0])}")
    if code == 0:
        for pattern in case.warns:
            if not re.search(pattern, err, re.M):
                outcome.problems.append(f"no stderr line matches {pattern!r} (stderr: {_excerpt(err)})")
        missing = [text for text in case.shows if text not in out]
        if missing:
            outcome.problems.append(f"stdout does not show {missing!r} literally: {_excerpt(out)}")
    if case.no_escapes:
        for char, name in (("\x1b", "ESC"), ("\x9b", "CSI (U+009B)"), ("\u202e", "U+202E")):
            if char in out + err:
                outcome.problems.append(f"a raw {name} reached the terminal")
    if outcome.seconds > LIMIT_S:
        outcome.problems.append(f"took {outcome.seconds:.2f} s (limit {LIMIT_S} s)")


def _excerpt(text: str, limit: int = 160) -> str:
    flat = " / ".join(line.strip() for line in text.strip().splitlines() if line.strip())
    return repr(flat[:limit] + ("..." if len(flat) > limit else ""))


# -- scripts, canary, secrets ---------------------------------------------------------------------------------


def _scripts(case: Case, world: World, outcome: Outcome, before: Snapshot, after: Snapshot) -> list[Path]:
    """Every script the command wrote (*.sbatch), printed (--stdout) or handed to sbatch (the stub's copies)."""
    found = [world.root / rel for rel in changed_paths(before, after)
             if rel.endswith(".sbatch") and after.get(rel, ("",))[0] == "file"]
    found += sorted(world.captured.iterdir())
    if "--stdout" in case.argv and outcome.code == 0 and outcome.out:
        printed = world.harness / "stdout.sbatch"
        printed.write_text(outcome.out, encoding="utf-8")
        found.append(printed)
    return found


def _run_scripts(world: World, scripts: list[Path], outcome: Outcome) -> None:
    bash = shutil.which("bash") or "/bin/bash"
    env = {"PATH": f"{world.script_stubs}:{world.stubs}:/usr/bin:/bin", "HOME": str(world.home),
           "CANARY": str(world.canary), "SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "n1", "SLURM_NTASKS": "1",
           "SLURM_NNODES": "1", "SLURM_NODEID": "0", "SLURM_CPUS_PER_TASK": "1", "SLURM_SUBMIT_DIR": str(world.work)}
    for script in scripts:
        try:
            subprocess.run([bash, str(script)], cwd=world.work, env=env, capture_output=True,
                           timeout=SCRIPT_TIMEOUT_S, check=False)
        except subprocess.TimeoutExpired:
            outcome.problems.append(f"{script.name} ran past {SCRIPT_TIMEOUT_S} s under bash")


def _check_secret(case: Case, world: World, outcome: Outcome) -> None:
    inputs = {world.work / "job.toml", world.work / "site.toml"}
    needle = case.leak.encode()
    for path in world.root.rglob("*"):
        if path in inputs or not stat.S_ISREG(path.lstat().st_mode):
            continue
        if needle in path.read_bytes():
            outcome.problems.append(f"the secret is written in {path.relative_to(world.root)}")


def _check_plans(world: World, outcome: Outcome, after: Snapshot) -> None:
    for rel, entry in after.items():
        if rel.endswith("plan.json") and entry[0] == "file":
            text = (world.root / rel).read_text(encoding="utf-8", errors="replace")
            if re.search(r"\bNaN\b|\bInfinity\b", text):
                outcome.problems.append(f"{rel} holds NaN or Infinity (not JSON)")


def run_case(case: Case, world: World) -> Outcome:
    """Run one case and fail with every problem found, named by the case's id."""
    argv = _prepare(case, world)
    before = snapshot(world)
    outcome = (_isolated if case.isolated else _in_process)(case, argv, world)
    after = snapshot(world)
    _check_messages(case, outcome)
    _check_tree(case, world, outcome, before, after)
    _check_plans(world, outcome, after)
    scripts = _scripts(case, world, outcome, before, after)
    submitted = case.entry == "submit" and "--dry-run" not in case.argv
    if submitted and outcome.code == 0 and not any(world.captured.iterdir()):
        outcome.problems.append("exit 0 but sbatch was never called (no script to run)")
    _run_scripts(world, scripts, outcome)
    if os.path.lexists(world.canary):
        outcome.problems.append("the canary was written: a payload ran")
    if case.leak:
        _check_secret(case, world, outcome)
    if case.check is not None and outcome.code in case.expect:
        try:
            case.check(world, outcome)
        except AssertionError as error:
            outcome.problems.append(f"check: {error}")
    if outcome.problems:
        pytest.fail(f"{case.id}: " + " | ".join(outcome.problems), pytrace=False)
    return outcome


# -- building cases -------------------------------------------------------------------------------------------

q = __import__("json").dumps  # a TOML basic string: JSON escapes are TOML escapes
_COMMANDS = {  # entry, argv before --site, the default site
    "dry": ("submit", ("@JOB@", "--dry-run", "--executor", "local"), "local"),
    "validate": ("main", ("validate", "@JOB@"), "local"),
    "render": ("main", ("render", "@JOB@"), "local-slurm"),
    "stdout": ("main", ("render", "@JOB@", "--stdout"), "local-slurm"),
    "submit": ("submit", ("@JOB@", "--executor", "slurm", "--no-follow"), "local-slurm"),
}
_SITE = {"": {"name": q("hostile")}, "slurm": {"enabled": "true", "partition": q("batch"), "max_time": q("1-00:00:00")},
         "node": {"gpus": "0", "cpus": "4"}, "network": {"interconnect": q("tcp"), "socket_ifname": q("lo")},
         "launch": {"launcher": q("srun")}, "preempt": {"signal": q("USR2"), "lead_seconds": "60"}}


def expect_of(value: int | tuple[int, ...]) -> tuple[int, ...]:
    return (value,) if isinstance(value, int) else tuple(value)


def on(command: str, case_id: str, job: str | None = "", *extra: str, expect: int | tuple[int, ...] = 2,
       site: str | None = None, **fields: object) -> Case:
    """``command`` (dry, validate, render, stdout, submit) on the job TOML ``job`` with ``extra`` arguments."""
    entry, argv, default_site = _COMMANDS[command]
    site_arg = "@SITE@" if site is not None else default_site
    return Case(case_id, (*argv, "--site", site_arg, *extra), job=job, entry=entry, expect=expect_of(expect),
                site=site, **fields)  # type: ignore[arg-type]


def across(commands: str, case_id: str, job: str | None = "", *extra: str, **fields: object) -> list[Case]:
    """The same input on each of the space-separated ``commands``; ids get the command as a suffix."""
    return [on(command, f"{case_id}-{command}", job, *extra, **fields) for command in commands.split()]


def command(case_id: str, *argv: str, expect: int | tuple[int, ...] = 2, **fields: object) -> Case:
    """Any ``python -m hpc_train`` command line (no job file unless ``job=`` is given)."""
    fields.setdefault("job", None)
    return Case(case_id, argv, expect=expect_of(expect), **fields)  # type: ignore[arg-type]


def site_toml(changes: dict[str, str]) -> str:
    """A Slurm site file with ``changes`` ("section.key" or "key" -> a TOML value) applied."""
    sections = {name: dict(keys) for name, keys in _SITE.items()}
    for dotted, value in changes.items():
        section, _, key = dotted.rpartition(".")
        sections.setdefault(section, {})[key] = value
    lines = [f"{key} = {value}" for key, value in sections.pop("").items()]
    for name, keys in sections.items():
        lines += [f"\n[{name}]", *(f"{key} = {value}" for key, value in keys.items())]
    return "\n".join(lines) + "\n"
