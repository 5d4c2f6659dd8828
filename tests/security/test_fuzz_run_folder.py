"""A seeded fuzzer over damaged run folders: every login-node reader and the follower's poll, in this process.

Why: each reader of a run folder once had its own checks, and the same few holes came back reader by reader (a
link below the run folder followed, a number no float or C long holds, a long line that hid the records after
it, a FIFO that hung). Here a generator of our own (``random.Random(seed)``, no new dependency) writes run folders
in the real writers' formats (:mod:`tests.failures.fixtures`, :class:`~hpc_train.run.attempts.AttemptLog`), damages
each in a few random ways, and runs ``status``, ``status --json``, ``logs`` (plain, ``--errors-only``,
``--rank 0``, ``--json``), ``ckpt ls --json``, ``ckpt verify``, plot's data reader and the follower's poll on
it. Every case asserts: exit 0 or 2 (``ckpt verify``: 1 too, no checkpoint resumes), no traceback, no
"unexpected failure", an answer within :data:`CASE_LIMIT_S`, nothing of the folder outside the run folder
(:data:`MARKER`, in every file a planted link points at) printed, no raw ESC byte printed, and ``--json`` that a
strict parser reads (no NaN, no Infinity).

CI runs :data:`DEFAULT_CASES` cases (about 20 s here; 400 took a minute of CI). Before a release, run more, with
another seed:
``HPC_TRAIN_FUZZ_CASES=5000 HPC_TRAIN_FUZZ_SEED=7 pytest tests/security/test_fuzz_run_folder.py``. A failing case
names its seed, its number and its damages: the same seed and number write the same folder again.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import random
import re
import shutil
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from hpc_train.errors import ConfigError
from hpc_train.login import main as hpc_main
from hpc_train.login.ops.plot_data import read_run
from hpc_train.login.slurm import follow
from hpc_train.run.attempts import AttemptLog
from tests.failures.fixtures import (
    T0,
    Rank,
    comm_traceback,
    stamp,
    user_traceback,
    write_batch,
    write_checkpoint,
    write_metrics,
    write_plan,
    write_rank,
)

SEED = int(os.environ.get("HPC_TRAIN_FUZZ_SEED", "39"))
DEFAULT_CASES = 240
CASES = int(os.environ.get("HPC_TRAIN_FUZZ_CASES") or DEFAULT_CASES)
CASE_LIMIT_S = 10.0  # a whole case: seven commands and the follower's poll; a hang is stopped by SIGALRM here
MARKER = "SECRETMARKER39"  # in every file of the folder that planted links point at; must never be printed
JOB = "4242"

# Numbers no float or C long holds, and the strict-JSON outliers (the JSON writers of Python write NaN as is).
NUMBERS = ["1" + "0" * 400, "9" * 5000, "-" + "9" * 30, "1e308", "-1e308", "1e400", "-1e400", "NaN", "Infinity",
           "-Infinity", "18446744073709551616", "9223372036854775808", "-9223372036854775809", "1e-400", "-1",
           "1.7976931348623157e308", "0", "4e10", "253402300800"]
VALUES = ['[1, 2]', '{"a": {}}', '"x"', 'null', 'true', '""', '"\\u001b[2J"', '"[/]"', '[' * 2000 + ']' * 2000]
LOG_LINES = [
    lambda: f"{stamp(20)} rank{'9' * 5000} ERROR boom",
    lambda: f"{stamp(21)} rank{'1' + '0' * 20} WARNING hang: rank {'9' * 5000} is not in a collective: x",
    lambda: "srun: error: n1: tasks 0-99999999999: Killed",
    lambda: f"srun: error: n1: task {'9' * 5000}: signal {'9' * 5000}",
    lambda: f"srun: error: n1: tasks 5-2,{'9' * 30}-{'9' * 31}: Segmentation fault",
    lambda: f"{stamp(22)} rank0 INFO start: srun rank {'9' * 5000}/2 (local 0/1, node {'9' * 40}/1) job {JOB} "
            "restart 0",
    lambda: f"{stamp(23)} rank0 ERROR out of memory: rank {'9' * 5000} was killed by the memory limit of its "
            "cgroup; its largest process peaked at 1.2.3 GiB",
    lambda: f"[rank{'9' * 5000}]: Traceback (most recent call last):",
    lambda: f"{stamp(24)} rank0 INFO saved step {'9' * 5000} 1.0 s after SIGTERM; requeued: x",
    lambda: "9999-12-31 23:59:59,999 rank0 ERROR the last second of the calendar",
    lambda: "0000-00-00 00:00:00,000 rank0 ERROR no such day",
    lambda: "\x1b[2J\x1b]0;retitled\x07 rank0 ERROR escape",
    lambda: "\x00\xff\ud800 not text",
]
# What a planted link may replace: files and folders at every depth below the run folder.
LINKABLE = ["logs", "checkpoints", "submitit", "heartbeats", "logs/nccl-trace", "logs/ranks-0-0.log",
            "logs/ranks-1-1.log", "logs/rank-1.error.json", "logs/slurm-4242.err", "checkpoints/latest",
            "submitit/4242_0_log.err", "attempts.jsonl", "metrics.jsonl", "plan.json", "health.json",
            "excluded_nodes.json", "logs/follower-cancel.json", f"heartbeats/recovery-{JOB}.0"]


class _Hang(BaseException):
    """Raised by SIGALRM in a case that ran past its limit (a BaseException: no handler of the command eats it)."""


@contextlib.contextmanager
def _deadline(seconds: float) -> Iterator[None]:
    def ring(signum: int, frame: Any) -> None:
        raise _Hang(f"no answer within {seconds} s")

    old = signal.signal(signal.SIGALRM, ring)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


# -- a run folder as the writers leave it ---------------------------------------------------------------------


def write_folder(run: Path, rng: random.Random, marker: str = "") -> None:
    """A failed Slurm run of two ranks in the real formats; ``marker`` goes into every text a reader shows."""
    write_plan(run, name=f"fuzz{marker}", executor=rng.choice(["slurm", "local"]), steps=50)
    run.chmod(0o700)
    (run / "logs" / "nccl-trace").mkdir(exist_ok=True)
    log = AttemptLog(run)
    first = log.begin(JOB, 0, f"n1{marker}", T0, 0)
    log.finish(first, outcome=rng.choice(["failed", "preempted", "hang", "killed"]), ended=T0 + 30, end_step=20,
               step_s_max=0.5, save_s_max=1.0, note=f"fuzz{marker}", signal="SIGTERM", requeued=rng.random() < 0.5)
    log.begin(JOB, 1, "n2", T0 + 40, 20)
    write_metrics(run, range(0, 30), T0, 1.0)
    if marker:
        with open(run / "metrics.jsonl", "a", encoding="utf-8") as out:
            out.write(json.dumps({"step": 31, marker: 1.0, "loss": 1.0, "time": T0 + 31}) + "\n")
    write_checkpoint(run, 20)
    if marker:
        (run / "checkpoints" / "latest").write_text(f"step-{marker}")
    write_rank(run, JOB, Rank(0, 0, lines=[(1.0, "INFO", f"step 1 {marker}"), (2.0, "WARNING", "hang: slow")],
                              error="", traceback=""), host=f"n1{marker}")
    write_rank(run, JOB, Rank(1, 1, error=f"RuntimeError('boom{marker}')",
                              traceback=user_traceback(f"RuntimeError: boom{marker}"), error_at=5.0),
               host=f"n2{marker}")
    write_rank(run, JOB, Rank(2, 1, error="DistBackendError('peer')", traceback=comm_traceback("x"), error_at=6.0))
    write_batch(run, JOB, f"srun: error: n2: task 1: Exited with exit code 1 {marker}\n")
    (run / "logs" / f"slurm-{JOB}.err").write_text(f"{stamp(7)} slurmstepd: error: *** STEP CANCELLED {marker}\n")
    (run / "health.json").write_text(json.dumps({"findings": [{"check": f"loss{marker}", "step": 3, "figure": 1.5,
                                                               "threshold": 1.0, "cause": "lr", "fix": "lower"}]}))
    (run / "excluded_nodes.json").write_text(json.dumps({"nodes": [{"node": "n9", "time": T0, "class": "x"}]}))
    (run / "logs" / "follower-cancel.json").write_text(json.dumps({"job_id": JOB, "time": T0, "reason": marker}))
    (run / "heartbeats").mkdir(mode=0o700, exist_ok=True)
    (run / "heartbeats" / f"recovery-{JOB}.0").write_text("1")


# -- damage -------------------------------------------------------------------------------------------------


def _files(run: Path) -> list[Path]:
    return sorted(p for p in run.rglob("*") if p.is_file() and not p.is_symlink())


def _rewrite(path: Path, change: Callable[[bytes], bytes]) -> None:
    path.write_bytes(change(path.read_bytes()))


def _swap_number(rng: random.Random, data: bytes) -> bytes:
    spots = [m.span() for m in re.finditer(rb"(?<![\w.])-?[0-9]+(?:\.[0-9]+)?(?:e-?[0-9]+)?(?![\w.])", data)]
    if not spots:
        return data + b"\n" + rng.choice(NUMBERS).encode()
    start, end = rng.choice(spots)
    return data[:start] + rng.choice(NUMBERS).encode() + data[end:]


def _swap_value(rng: random.Random, data: bytes) -> bytes:
    spots = [m.end() for m in re.finditer(rb'": ', data)]
    if not spots:
        return data
    at = rng.choice(spots)
    end = re.search(rb"[,}\n]", data[at:])
    return data[:at] + rng.choice(VALUES).encode() + (data[at + end.start():] if end else b"")


def _damage_content(rng: random.Random, path: Path) -> str:
    kind = rng.choice(["truncate", "huge-line", "binary", "deep", "number", "number", "number", "value", "value",
                       "log-line", "log-line", "escape", "empty", "many-lines"])
    if kind == "truncate":
        _rewrite(path, lambda d: d[:rng.randrange(len(d) + 1)])
    elif kind == "huge-line":
        size = rng.choice([70_000, (1 << 20) + 1, 2_500_000])
        line = b'{"step": 1, "x": "' + b"y" * size + b'"}\n'
        _rewrite(path, lambda d: d[:len(d) // 2] + b"\n" + line + d[len(d) // 2:])
    elif kind == "binary":
        _rewrite(path, lambda d: d + bytes(rng.randrange(256) for _ in range(rng.randrange(1, 300))))
    elif kind == "deep":
        _rewrite(path, lambda d: d + b"\n" + rng.choice([b"[" * 100_000, b'{"a":' * 50_000, b"[" * 100_000 + b"]" *
                                                         100_000]) + b"\n")
    elif kind == "number":
        for _ in range(rng.randrange(1, 4)):
            _rewrite(path, lambda d: _swap_number(rng, d))
    elif kind == "value":
        _rewrite(path, lambda d: _swap_value(rng, d))
    elif kind == "log-line":
        _rewrite(path, lambda d: d + ("\n".join(rng.choice(LOG_LINES)() for _ in range(3)) + "\n").encode(
            "utf-8", "surrogatepass"))
    elif kind == "escape":
        _rewrite(path, lambda d: d.replace(b"boom", b"\x1b[2J\x1b]0;pwned\x07boom").replace(b'"n2', b'"\x1b[31mn2'))
    elif kind == "empty":
        path.write_bytes(b"")
    else:
        _rewrite(path, lambda d: d + b"\n" * rng.randrange(1, 50_000))
    return f"{kind} {path.name}"


def _plant(rng: random.Random, run: Path, victim: Path) -> str:
    name = rng.choice(LINKABLE)
    target, where = victim / name, run / name
    if not os.path.lexists(where):
        return ""
    if where.is_dir() and not where.is_symlink():
        shutil.rmtree(where)
    else:
        where.unlink()
    where.symlink_to(target)
    return f"link {name}"


def _special(rng: random.Random, run: Path) -> str:
    files = _files(run)
    path = rng.choice(files)
    path.unlink()
    if rng.random() < 0.7:
        os.mkfifo(path)
        return f"fifo {path.relative_to(run)}"
    path.mkdir()
    return f"folder {path.relative_to(run)}"


def damage(rng: random.Random, run: Path, victim: Path) -> list[str]:
    """One to four damages; what was done, for the failure message."""
    done = []
    for _ in range(rng.randrange(1, 5)):
        roll = rng.random()
        if roll < 0.25:
            done.append(_plant(rng, run, victim))
        elif roll < 0.35:
            done.append(_special(rng, run))
        elif files := _files(run):
            done.append(_damage_content(rng, rng.choice(files)))
    return [d for d in done if d]


# -- running the readers ------------------------------------------------------------------------------------


def _strict(text: str) -> Any:
    def refuse(constant: str) -> None:
        raise ValueError(f"{constant} is not JSON")

    return json.loads(text, parse_constant=refuse)


def _run(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = hpc_main.main(argv)
        except SystemExit as exit_:
            code = exit_.code if isinstance(exit_.code, int) else 1
    return code, out.getvalue(), err.getvalue()


def _plot_data(run: Path) -> tuple[int, str, str]:
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            series = read_run(run)
        except ConfigError as error:
            return 2, "", f"error: {error}"
    return 0, json.dumps([series.summary(), series.series], allow_nan=False), err.getvalue()


def _follower(run: Path) -> tuple[int, str, str]:
    """One poll of the follower on a job whose state says it failed: its log lines, the rank errors, the cancel
    decision and the failure report."""
    out = io.StringIO()
    job = follow.FollowedJob(type("Job", (), {"job_id": JOB})(), run, submitted_at=T0, state="FAILED", requeue=True)
    console = Console(file=out, width=200)
    with contextlib.redirect_stderr(out):
        lines = job.tail.new_lines()
        job.rank_errors()
        job.cancel_decision()
        follow._report_failure(console, job)
    return 0, "\n".join([*lines, out.getvalue()]), ""


def _commands(run: Path) -> list[tuple[str, Callable[[], tuple[int, str, str]]]]:
    where = str(run)
    return [(" ".join(argv), lambda argv=argv: _run(argv)) for argv in (
        ["status", where], ["status", "--json", where], ["logs", where], ["logs", "--errors-only", where],
        ["logs", "--rank", "0", where], ["logs", "--json", where], ["ckpt", "ls", where, "--json"],
        ["ckpt", "verify", where])] + [
        ("plot data", lambda: _plot_data(run)), ("follower poll", lambda: _follower(run))]


def _problems(name: str, code: int, out: str, err: str) -> list[str]:
    said = out + err
    found = []
    if code not in ((0, 1, 2) if name.startswith("ckpt verify") else (0, 2)):  # 1: no checkpoint resumes
        found.append(f"{name}: exit {code}: {err[-300:]!r}")
    if "Traceback" in err:  # stdout shows the ranks' own tracebacks (logs); stderr is the command's word
        found.append(f"{name}: a traceback: {err[err.index('Traceback'):][:300]!r}")
    if re.search(r"unexpected failure|internal error", said, re.I):
        found.append(f"{name}: the catch-all handler: {err[-300:]!r}")
    if MARKER in said:
        found.append(f"{name}: printed the marker of the folder a link points at")
    if "\x1b" in said:
        found.append(f"{name}: a raw ESC byte reached the terminal")
    if code == 0 and "--json" in name:
        try:
            _strict(out)
        except ValueError as error:
            found.append(f"{name}: --json is not strict JSON ({error})")
    return found


def fuzz_case(root: Path, seed: int, number: int) -> tuple[list[str], list[str]]:
    """(what was damaged, the problems found) of case ``number`` of ``seed``."""
    rng = random.Random(f"{seed}:{number}")  # noqa: S311 - reproducible damage, not secrets
    run, victim = root / "runs" / "fuzz", root / "victim"
    write_folder(victim, random.Random(0), marker=MARKER)  # noqa: S311
    write_folder(run, rng)
    done = damage(rng, run, victim)
    if rng.random() < 0.03:  # the run folder itself a link: refused
        shutil.rmtree(run)
        run.symlink_to(victim)
        done.append("link the run folder")
    problems = []
    for name, call in _commands(run):
        if name == "follower poll" and run.is_symlink():
            continue  # the follower follows the run folder submit checked and made, never one given by hand
        start = time.monotonic()
        try:
            with _deadline(CASE_LIMIT_S):
                code, out, err = call()
        except _Hang as error:
            problems.append(f"{name}: {error}")
            continue
        except Exception as error:  # what a reader let escape is the finding
            problems.append(f"{name}: {type(error).__name__} escaped: {str(error)[:200]}")
            continue
        problems += _problems(name, code, out, err)
        if time.monotonic() - start > CASE_LIMIT_S / 2:
            problems.append(f"{name}: took {time.monotonic() - start:.1f} s")
    return done, problems


@pytest.fixture
def fuzz_world(tmp_path: Path, stub_tools: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A private tmp tree: stub Slurm tools first on PATH (status asks squeue and sacct), TMPDIR inside (an error
    file of the catch-all handler would show there)."""
    monkeypatch.setenv("PATH", f"{stub_tools / 'bin'}{os.pathsep}{os.environ.get('PATH', '/usr/bin:/bin')}")
    (tmp_path / "tmp").mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))
    monkeypatch.setenv("COLUMNS", "200")
    return tmp_path


@pytest.mark.parametrize("block", range(max(1, CASES // 20)))
def test_damaged_run_folders_never_crash_hang_or_leak(fuzz_world: Path, block: int) -> None:
    """Twenty cases a test: one pytest item per case would cost more than the case."""
    failures = []
    for number in range(block * 20, min(CASES, block * 20 + 20)):
        root = fuzz_world / f"case-{number}"
        root.mkdir()
        done, problems = fuzz_case(root, SEED, number)
        if problems:
            failures.append(f"case {number} (seed {SEED}; {', '.join(done) or 'no damage'}): {'; '.join(problems)}")
        shutil.rmtree(root)
    assert not list((fuzz_world / "tmp").iterdir()), "the catch-all handler wrote an error file"
    assert not failures, "\n".join(failures)
