"""Hostile command lines: entry points that would run code if imported, sweeps that vary what a job array shares
or grow without bound, sbatch refusing a sweep, and --set / --template / --out values nobody should type.

Why: the login node must never import the user's code (a package's __init__ runs on import), a sweep of 27,000
runs must be refused at once rather than planned for a minute, and a submission sbatch refuses must leave no run
folders or submitit pickles behind.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable

import pytest

from tests.security.harness import Case, Outcome, World, across, cases_ids, command, on, q, run_case

EVIL = ("import pathlib\npathlib.Path({canary!r}).touch()\n\n\ndef main(ctx=None):\n    pass\n\n\n"
        "build = dataset = collate = main\n")


def _evil_code(world: World) -> None:
    """Python that creates the canary when imported: as a file, and as a package in the config's folder."""
    text = EVIL.format(canary=str(world.canary))
    (world.root / "evil.py").write_text(text, encoding="utf-8")
    package = world.work / "evilpkg"
    package.mkdir()
    for name in ("__init__.py", "mod.py"):
        (package / name).write_text(text, encoding="utf-8")


ENTRY_OK = [("program-file", "job", "program", "@ROOT@/evil.py:main"),
            ("program-script", "job", "program", "@ROOT@/evil.py"),
            ("program-module", "job", "program", "evilpkg.mod:main"),
            ("program-package", "job", "program", "evilpkg:main"),
            ("model-file", "train", "model", "@ROOT@/evil.py:build"),
            ("model-module", "train", "model", "evilpkg.mod:build"),
            ("source-file", "data", "source", "@ROOT@/evil.py:dataset"),
            ("collate-file", "data", "collate", "@ROOT@/evil.py:collate")]
ENTRY_BAD = [("program-missing-script", "nope.py"), ("program-missing-module", "pkg.missing:fn"),
             ("program-traversal-missing", "../../etc/passwd:x"), ("program-semicolon", "evil.py:main; touch @CANARY@"),
             ("program-two-colons", "a:b:c"), ("program-newline", "evilpkg.mod:main\ntouch @CANARY@"),
             ("program-subst", "$(touch @CANARY@).py"), ("program-folder", "@VICTIM@"),
             ("program-bad-function", "@ROOT@/evil.py:ma-in"), ("program-esc", "evilpkg.mod:main\x1b[2J")]
ENTRY_EITHER = [("program-etc-passwd", "/etc/passwd:x"), ("program-os-system", "os:system"),
                ("program-subprocess", "subprocess:run"), ("program-builtins", "builtins:exec")]


def _entry_cases() -> list[Case]:
    cases = []
    for label, section, key, value in ENTRY_OK:
        cases += across("dry validate", f"entry-{label}", f"[{section}]\n{key} = {q(value)}\n", expect=0,
                        setup=_evil_code)
    cases.append(on("render", "entry-program-file-render", f"[job]\nprogram = {q(ENTRY_OK[0][3])}\n", expect=0,
                    setup=_evil_code))
    cases += [on("dry", f"entry-{label}", f"[job]\nprogram = {q(value)}\n", says=("job.program",), setup=_evil_code)
              for label, value in ENTRY_BAD]
    cases += [on("validate", f"entry-{label}", f"[job]\nprogram = {q(value)}\n", expect=(0, 2), setup=_evil_code)
              for label, value in ENTRY_EITHER]
    return cases


SUBMIT = ("@JOB@", "--site", "local-slurm", "--executor", "slurm", "--no-follow")
DRY = ("@JOB@", "--site", "local", "--executor", "local", "--dry-run")


def _names_cap(world: World, outcome: Outcome) -> None:
    line = next(line for line in outcome.err.splitlines() if line.startswith("error:"))
    assert re.search(r"\d", line) and re.search(r"at most|more than|limit|cap|maximum|too many", line), \
        f"the message names no cap: {line[:200]!r}"


def _sweep(case_id: str, *sweeps: str, base: tuple[str, ...] = DRY, **fields: object) -> Case:
    argv = [*base]
    for text in sweeps:
        argv += ["--sweep", text]
    return Case(case_id, tuple(argv), entry="submit", **fields)  # type: ignore[arg-type]


def _sweep_cases() -> list[Case]:
    many = ",".join(f"{i}e-5" for i in range(1, 10_001))
    thirty = ",".join(str(i) for i in range(1, 31))
    swept = ("runs/hpc-train-000", "runs/hpc-train-001", "runs/.submitit")
    return [
        _sweep("sweep-sbatch-refuses", "train.lr=1e-3,2e-3,3e-3", base=SUBMIT, refuse_sbatch=True, says=("sbatch",)),
        Case("submit-sbatch-refuses", SUBMIT, entry="submit", refuse_sbatch=True, says=("sbatch",)),
        _sweep("sweep-leading-space", " job.partition=a,b"),
        _sweep("sweep-space-before-equals", "job.partition =a,b"),
        _sweep("sweep-trailing-space-key", "job.partition\t=a,b"),
        _sweep("sweep-upper-section", "JOB.partition=a,b"),
        _sweep("sweep-job-name", "job.name=a,b"),
        _sweep("sweep-job-nodes", "job.nodes=1,2"),
        _sweep("sweep-env-leading-space", " env.FOO=a,b"),
        _sweep("sweep-preempt", "preempt.signal=USR2,TERM"),
        _sweep("sweep-payload-value", "train.lr=1e-3,$(touch @CANARY@)"),
        _sweep("sweep-newline-value", "train.lr=1e-3,2e-3\n#SBATCH --wrap=touch @CANARY@"),
        _sweep("sweep-empty-values", "train.lr="),
        _sweep("sweep-10000-values", f"train.lr={many}", isolated=True, check=_names_cap),
        _sweep("sweep-27000-combinations", f"train.seed={thirty}", f"train.steps={thirty}",
               f"zero.bucket_size={thirty}",
               isolated=True, check=_names_cap),
        _sweep("sweep-two-values-dry", "train.lr=1e-3,2e-3", expect=(0,)),
        _sweep("sweep-two-values-submit", "train.lr=1e-3,2e-3", base=SUBMIT, expect=(0,), allowed=swept,
               job='[env]\nFOO = "$(touch @CANARY@)"\n'),
        _sweep("sweep-evil-model", "train.model=tiny,@ROOT@/evil.py:build", expect=(0,), setup=_evil_code),
    ]


MB = "a" * (1 << 20)
SETS = [("env-name-newline", "env.X\n=1", (0, 2)), ("dunder-section", "__class__.x=1", 2),
        ("name-newline", "job.name=a\nb", 2),
        ("dot-only", ".=1", 2), ("no-key", "=1", 2), ("empty-key", "job.=1", 2), ("three-parts", "job.name.x=1", 2),
        ("lr-payload", "train.lr=1e-3; touch @CANARY@", 2), ("name-1mb", f"job.name={MB}", 2),
        ("partition-1mb", f"job.partition={MB}", 2), ("env-value-1mb", f"env.FOO={MB}", (0, 2)),
        ("env-name-1mb", f"env.{MB}=1", 2), ("exclude-payload", "job.exclude=n1\n#SBATCH --wrap=touch @CANARY@", 2),
        ("time-payload", "job.time=01:00:00;touch @CANARY@", 2),
        ("run-root-subst", "job.run_root=$(touch @CANARY@)", 2),
        ("env-value-subst", "env.FOO=$(touch @CANARY@)", 0), ("section-nul", "job\x00.name=x", 2),
        ("params-key-dot", "params.a.b=1", 2), ("deepspeed-proto", "deepspeed.__proto__=1", (0, 2))]


def _out_link(world: World) -> None:
    os.symlink(world.victim_file, world.work / "out.sbatch")


def _set_cases() -> list[Case]:
    cases = [on("render", f"set-{label}", "", "--set", text, expect=code) for label, text, code in SETS]
    cases += [
        on("render", "template-traversal", "", "--template", "../../etc/passwd", says=("--template",)),
        on("render", "template-newline", "", "--template", "srun\n#SBATCH", says=("--template",)),
        on("render", "out-is-folder", "", "--out", "@VICTIM@", says=("--out",)),
        on("render", "out-is-link-to-victim", "", "--out", "@WORK@/out.sbatch", expect=(0, 2), setup=_out_link,
           allowed=("work/out.sbatch",)),
        command("validate-world-negative", "validate", "@JOB@", "--world", "-1", job=""),
        command("validate-world-huge", "validate", "@JOB@", "--world", "1180591620717411303424", job="", isolated=True),
        command("status-watch-zero", "status", "@RUN@", "--watch", "0", setup=lambda w: w.run_dir.mkdir(mode=0o700)),
        command("status-watch-nan", "status", "@RUN@", "--watch", "nan", setup=lambda w: w.run_dir.mkdir(mode=0o700)),
    ]
    return cases


def _fifo(name: str) -> Callable[[World], None]:
    return lambda world: os.mkfifo(world.work / name)


def _export_target(world: World) -> None:
    world.run_dir.mkdir(parents=True, mode=0o700)
    (world.run_dir / "plan.json").write_text("{}")
    os.mkfifo(world.work / "model.pt")


def _out_cases() -> list[Case]:
    """Outputs that are not plain files (issue 39): refused before anything is written, the run folder included."""
    return [
        on("render", "out-fifo", "", "--out", "@WORK@/out.sbatch", says=("--out", "FIFO"), setup=_fifo("out.sbatch")),
        on("render", "out-missing-folder", "", "--out", "@WORK@/no/out.sbatch", says=("--out", "does not exist")),
        on("render", "out-device", "", "--out", "/dev/null", says=("--out", "device")),
        on("render", "out-under-a-file", "", "--out", "@JOB@/out.sbatch", says=("--out",)),
        command("plot-out-fifo-svg", "plot", "@RUN@", "--out", "@WORK@/p.svg", says=("--out", "FIFO"),
                setup=_fifo("p.svg"), isolated=True),
        command("plot-out-fifo-png", "plot", "@RUN@", "--out", "@WORK@/p.png", says=("--out", "FIFO"),
                setup=_fifo("p.png"), isolated=True),
        command("bench-out-fifo", "bench", "allreduce", "--out", "@WORK@/b.json", says=("--out", "FIFO"),
                setup=_fifo("b.json")),
        command("ckpt-export-out-fifo", "ckpt", "export", "@RUN@", "--out", "@WORK@/model.pt", "--force",
                says=("--out", "FIFO"), setup=_export_target),
    ]


def _echo_cases() -> list[Case]:
    """Text typed on the command line is echoed escaped, on one line (issue 39)."""
    return [
        command("unknown-argument-esc", "validate", "@JOB@", "--x\x1b]0;pwned\x07", job="", no_escapes=True,
                says=("unrecognized arguments", "\\x1b")),
        command("unknown-command-csi", "\x9b2J", no_escapes=True),
        command("config-path-esc", "validate", "@WORK@/job\x1b[2J.toml", no_escapes=True, says=("\\x1b",)),
        command("config-path-newline", "validate", "@WORK@/job.toml\nerror: fake", says=("\\n",)),
        command("set-newline-esc", "validate", "@JOB@", "--set", "job.name=a\n\x1b[2J", job="", no_escapes=True),
    ]


CASES = [*_entry_cases(), *_sweep_cases(), *_set_cases(), *_out_cases(), *_echo_cases()]


@pytest.mark.parametrize("case", CASES, ids=cases_ids(CASES))
def test_hostile_command_line(case: Case, world: World) -> None:
    run_case(case, world)
