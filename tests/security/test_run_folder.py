"""What a run folder holds, read back by submit --dry-run, render, status and logs: torn, hostile or huge files.

Why: ranks (or anyone who edits a run folder by hand) write attempts.jsonl, excluded_nodes.json, plan.json,
checkpoints/latest and the logs that login-node commands read later. A bad line must cost a warning naming the file
and line, never the command; text read from disk must reach the terminal as text (no rich markup interpreted, no
raw ESC or CSI bytes that retitle or clear the terminal).
"""

from __future__ import annotations

import json
import os

import pytest

from tests.security.harness import Case, World, cases_ids, command, on, run_case

GOOD = {"attempt": 1, "job_id": "4242", "restart": 0, "host": "n1", "started": 1700000000.0, "start_step": 0,
        "outcome": "completed", "ended": 1700000100.0, "end_step": 100}
PLAN = {"name": "hpc-train", "executor": "local", "config": {"train": {"steps": 100}}}


def _line(**changes: object) -> str:
    return json.dumps({**GOOD, "attempt": 2, **changes}, allow_nan=True)


def _folder(files: dict[str, str | bytes]):
    """A run folder of the job (run_root/hpc-train, 0700) with a plan.json and ``files``."""

    def setup(world: World) -> None:
        world.run_dir.mkdir(mode=0o700)
        (world.run_dir / "logs").mkdir(mode=0o700)
        contents = {"plan.json": json.dumps(PLAN), **files}
        for name, data in contents.items():
            path = world.run_dir / name
            path.parent.mkdir(parents=True, exist_ok=True)
            data = world.sub(data) if isinstance(data, str) else data
            (path.write_text(data, encoding="utf-8") if isinstance(data, str) else path.write_bytes(data))
    return setup


ATTEMPT_LINES = [("garbage", "not json at all {"), ("json-array", "[1, 2, 3]"), ("json-null", "null"),
                 ("attempt-str", _line(attempt="x")), ("started-yesterday", _line(started="yesterday")),
                 ("started-nan", _line(started=float("nan"))), ("job-id-int", _line(job_id=42)),
                 ("step-s-max-str", _line(step_s_max="slow")), ("restart-list", _line(restart=[1])),
                 ("garbage-10mb", "{" + "x" * (10 << 20))]
ATTEMPT_BYTES = [("binary", b"\xff\xfe\x00\x9b\x1b[2J garbage")]
WARN_LINE = r"attempts\.jsonl.*\b2\b|\b2\b.*attempts\.jsonl"
EXCLUSIONS = [("not-json", "nope{"), ("nodes-str", '{"nodes": "x"}'),
              ("time-noon", '{"nodes": [{"node": "a", "time": "noon"}]}'),
              ("node-shell", '{"nodes": [{"node": "n;rm -rf"}]}'), ("json-array", "[]"),
              ("node-newline", '{"nodes": [{"node": "n1\\n#SBATCH --wrap=touch @CANARY@"}]}'),
              ("node-markup", '{"nodes": [{"node": "[/]"}]}'), ("deep", "[" * 100_000 + "]" * 100_000)]


def _attempt_cases() -> list[Case]:
    cases = []
    lines = [(label, text.encode()) for label, text in ATTEMPT_LINES] + ATTEMPT_BYTES
    for label, bad in lines:
        setup = _folder({"attempts.jsonl": json.dumps(GOOD).encode() + b"\n" + bad + b"\n"})
        cases.append(on("dry", f"attempts-{label}-dry", "", expect=0, setup=setup, warns=(WARN_LINE,)))
        cases.append(command(f"attempts-{label}-status", "status", "@RUN@", expect=0, setup=setup, warns=(WARN_LINE,)))
    huge = _folder({"attempts.jsonl": _line(note="n" * (10 << 20)) + "\n"})
    cases.append(command("attempts-note-10mb-status", "status", "@RUN@", expect=0, setup=huge))
    cases.append(on("dry", "attempts-note-10mb-dry", "", expect=0, setup=huge))
    return cases


def _exclusion_cases() -> list[Case]:
    cases = []
    for label, text in EXCLUSIONS:
        setup = _folder({"excluded_nodes.json": text})
        cases.append(on("dry", f"excluded-{label}-dry", "", expect=0, setup=setup, warns=(r"excluded_nodes\.json",)))
        cases.append(command(f"excluded-{label}-status", "status", "@RUN@", expect=0, setup=setup,
                             warns=(r"excluded_nodes\.json",)))
    cases.append(on("render", "excluded-node-newline-render", "", expect=(0, 2),
                    setup=_folder({"excluded_nodes.json": EXCLUSIONS[5][1]})))
    return cases


def _shown(label: str, files: dict[str, str | bytes], *argv: str, **fields: object) -> Case:
    return command(label, *(argv or ("status", "@RUN@")), expect=fields.pop("expect", 0), setup=_folder(files),
                   **fields)


ESC = "\x1b]0;pwned\x07\x1b[2J"
MARKUP = ["[/]", "[link=http://evil]x[/link]", "[bold]x", "[/bold]"]


def _display_cases() -> list[Case]:
    cases = []
    for index, text in enumerate(MARKUP):
        cases.append(_shown(f"status-job-id-markup-{index}", {"attempts.jsonl": _line(job_id=text) + "\n"}))
        failed = _line(note=text, outcome="failed") + "\n"
        cases.append(_shown(f"status-note-markup-{index}", {"attempts.jsonl": failed}))
    cases += [
        _shown("status-slurm-job-id-markup", {"plan.json": json.dumps({**PLAN, "executor": "slurm"}),
                                              "attempts.jsonl": _line(job_id="[/]") + "\n"}),
        _shown("status-host-markup", {"attempts.jsonl": _line(host="[bold]x", outcome="running") + "\n"}),
        _shown("status-plan-name-markup", {"plan.json": json.dumps({**PLAN, "name": "[/]"})}, shows=("[/]",)),
        _shown("status-latest-markup", {"checkpoints/latest": "[/]\n"}, shows=("[/]",)),
        _shown("status-latest-esc", {"checkpoints/latest": f"step-1{ESC}\n"}, no_escapes=True),
        _shown("status-note-esc", {"attempts.jsonl": _line(note=ESC, outcome="failed") + "\n"}, no_escapes=True),
        _shown("status-note-csi", {"attempts.jsonl": _line(note="\x9b2J\x9b31m", outcome="failed") + "\n"},
               no_escapes=True),
        _shown("status-note-bidi", {"attempts.jsonl": _line(note="abc\u202edcba", outcome="failed") + "\n"},
               no_escapes=True),
        _shown("status-host-esc", {"attempts.jsonl": _line(host=ESC, outcome="running") + "\n"}, no_escapes=True),
        _shown("status-plan-name-esc", {"plan.json": json.dumps({**PLAN, "name": ESC})}, no_escapes=True),
        _shown("status-file-names-esc", {"plan.json": json.dumps({**PLAN, "executor": "slurm"}),
                                         f"logs/slurm-1{ESC}.out": "x\n", f"submitit/1{ESC}_submitted.pkl": b"x",
                                         f"logs/rank-0{ESC}.error.json": "{}"}, no_escapes=True),
        _shown("status-json-esc", {"attempts.jsonl": _line(note=ESC) + "\n"}, "status", "@RUN@", "--json",
               no_escapes=True),
        _shown("status-plan-deep", {"plan.json": "[" * 100_000 + "]" * 100_000}, expect=(0, 2)),
        _shown("status-plan-binary", {"plan.json": b"\xff\xfe{"}, expect=(0, 2)),
        _shown("status-metrics-garbage", {"metrics.jsonl": '{"step": "[/]", "loss": "nan"}\n{"step": 1e999}\n'}),
        _shown("logs-rank-log-esc", {"logs/ranks-0-1.log": f"2024-01-01 00:00:00,000 rank0 INFO hi {ESC}\n"},
               "logs", "@RUN@", no_escapes=True),
        _shown("logs-slurm-file-name-esc", {f"logs/slurm-1{ESC}.out": "hello\n"}, "logs", "@RUN@", no_escapes=True),
        _shown("logs-error-json-deep", {"logs/rank-0.error.json": "[" * 100_000 + "]" * 100_000}, "logs", "@RUN@",
               expect=(0, 2)),
        _shown("logs-rank-log-binary", {"logs/rank-0.log": b"\xff\xfe\x00 not text\n"}, "logs", "@RUN@"),
        _shown("logs-tail-negative", {}, "logs", "@RUN@", "--tail", "-1", expect=2),
        _shown("logs-rank-missing", {}, "logs", "@RUN@", "--rank", "99", expect=2),
        command("logs-rank-log-fifo", "logs", "@RUN@", expect=(0, 2), isolated=True, setup=_fifo_log),
        command("logs-missing-folder", "logs", "@ROOT@/nope"),
        command("status-missing-folder", "status", "@ROOT@/nope"),
        command("status-not-a-run-folder", "status", "@VICTIM@"),
        command("status-a-file", "status", "@VICTIM@/precious.txt"),
        command("status-no-runs-here", "status"),
    ]
    return cases


def _fifo_log(world: World) -> None:
    _folder({})(world)
    os.mkfifo(world.run_dir / "logs" / "ranks-0-0.log")


CASES = [*_attempt_cases(), *_exclusion_cases(), *_display_cases()]


@pytest.mark.parametrize("case", CASES, ids=cases_ids(CASES))
def test_run_folder_content(case: Case, world: World) -> None:
    run_case(case, world)
