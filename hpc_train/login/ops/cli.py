"""The ``logs``, ``status`` and ``plot`` commands of ``python -m hpc_train``; options are checked before anything
is read.

Exit status: 0 shown; 2 bad input (a folder that is not a run folder or has no metrics, a negative --tail, a
--watch of 0, a --metric no run logged, a missing matplotlib).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from hpc_train.common.terminal import plain, print_json
from hpc_train.errors import ConfigError

__all__ = ["add_cancel_parser", "add_logs_parser", "add_plot_parser", "add_status_parser"]

_LOGS_ABOUT = ("Every rank's log lines of a run (the nodes' logs/ranks-FIRST-LAST.log, each line naming its rank, or "
               "an older run's logs/rank-N.log; and Slurm's logs/slurm-*.out/err) as one timeline with rank "
               "prefixes, ordered by time; each rank's error (a line of its node's logs/errors-FIRST-LAST.jsonl, or "
               "logs/rank-N.error.json) and every error record first. "
               "See docs/operations.md.")
_STATUS_ABOUT = ("Where runs stand: the scheduler's state and nodes (one squeue and one sacct call per poll for all "
                 "runs), the last step, loss, tokens/s, MFU, ETA, the last checkpoint, the attempts and the failure "
                 "class of a failed attempt. See docs/operations.md.")


def _logs(args: argparse.Namespace) -> int:
    from hpc_train.login.ops.logs import format_text, merged_view

    view = merged_view(args.run_dir, rank=args.rank, errors_only=args.errors_only, tail=args.tail)
    if args.json:
        print_json(view.to_dict())
    else:
        print(plain(format_text(view)))
    return 0


def _status(args: argparse.Namespace) -> int:
    if args.watch is not None and not args.watch > 0:
        raise ConfigError("--watch", f"{args.watch} seconds between polls", "give a positive number, like --watch 10")
    from hpc_train.login.ops.status import collect, find_run_dirs, render, to_json

    run_dirs = find_run_dirs(args.run_dirs)
    if args.json:
        while True:
            statuses, answer = collect(run_dirs)
            # to_json's text read back and printed strictly: a NaN a damaged record carried becomes null
            print_json(json.loads(to_json(statuses, answer)), indent=None if args.watch else 2, flush=True)
            if args.watch is None:
                return 0
            try:
                time.sleep(args.watch)
            except KeyboardInterrupt:
                return 0
    from rich.console import Console

    console = Console()
    if not console.is_terminal:
        console = Console(width=200)  # a file or a pipe: one row per run, not 80 columns of wrapped cells
    if args.watch is None:
        console.print(render(*collect(run_dirs)))
        return 0
    from rich.live import Live

    with Live(render(*collect(run_dirs), trend=True), console=console, auto_refresh=False) as live:
        try:
            while True:
                time.sleep(args.watch)
                live.update(render(*collect(run_dirs), trend=True), refresh=True)
        except KeyboardInterrupt:
            pass
    return 0


_PLOT_ABOUT = ("A picture of runs (no port to forward): loss and eval loss, lr, tokens/s and the step breakdown "
               "against step from metrics.jsonl, one colour per run, every attempt's start and every preemption, "
               "requeue or failure marked from attempts.jsonl. Needs matplotlib (the plot extra). See "
               "docs/operations.md.")


def _plot(args: argparse.Namespace) -> int:
    """``--out`` is checked before any run folder is read (:func:`check_plot_out`), then the picture drawn."""
    from hpc_train.login.ops.plot import check_plot_out, choose_panels, draw
    from hpc_train.login.ops.plot_data import read_run

    out = check_plot_out(args.out or Path("plot.png"))
    runs = [read_run(run_dir) for run_dir in args.run_dirs]
    panels = choose_panels(runs, args.metric)
    draw(runs, panels, out)
    if args.json:
        print_json({"out": str(out), "panels": [list(panel) for panel in panels],
                    "runs": [run.summary() for run in runs]})
    else:
        marks = sum(len(run.marks) for run in runs)
        print(plain(f"wrote {out}: {len(panels)} panel(s), {len(runs)} run(s), {marks} attempt mark(s)",
                    one_line=True))
    return 0


def add_plot_parser(commands: Any) -> None:
    """Register ``plot`` on the main CLI's subcommands."""
    parser = commands.add_parser("plot", help="draw runs' metrics against step, with every attempt marked",
                                 description=_PLOT_ABOUT)
    parser.add_argument("run_dirs", type=Path, nargs="+", metavar="RUN_DIR", help="run folders, like runs/tiny-gpt")
    parser.add_argument("--out", type=Path, metavar="FILE", help="the picture: .png, .svg or .pdf (default plot.png)")
    parser.add_argument("--metric", action="append", metavar="NAME",
                        help="draw this metric of metrics.jsonl in a panel of its own (repeatable)")
    parser.add_argument("--json", action="store_true", help="also print what was drawn: panels, points, marks")
    parser.set_defaults(run=_plot)


def add_logs_parser(commands: Any) -> None:
    """Register ``logs`` on the main CLI's subcommands."""
    parser = commands.add_parser("logs", help="all rank logs of a run as one timeline, errors first",
                                 description=_LOGS_ABOUT)
    parser.add_argument("run_dir", type=Path, metavar="RUN_DIR", help="the run folder, like runs/tiny-gpt")
    parser.add_argument("--rank", type=int, metavar="N", help="only rank N's log and error")
    parser.add_argument("--errors-only", action="store_true", help="only the errors, no timeline")
    parser.add_argument("--tail", type=int, metavar="N", help="only the last N records of the timeline")
    parser.add_argument("--json", action="store_true", help="print errors and records as JSON")
    parser.set_defaults(run=_logs)


def add_status_parser(commands: Any) -> None:
    """Register ``status`` on the main CLI's subcommands."""
    parser = commands.add_parser("status", help="where runs stand: scheduler state, step, loss, ETA, attempts",
                                 description=_STATUS_ABOUT)
    parser.add_argument("run_dirs", type=Path, nargs="*", metavar="RUN_DIR",
                        help="run folders (default: every ./runs/* with a plan.json)")
    parser.add_argument("--json", action="store_true", help="print every detail as JSON (one line per poll with "
                                                            "--watch)")
    parser.add_argument("--watch", type=float, metavar="SECONDS", help="poll every SECONDS and redraw until Ctrl-C")
    parser.set_defaults(run=_status)


def _cancel(args: argparse.Namespace) -> int:
    from hpc_train.login.ops.cancel import cancel_run

    print(plain(cancel_run(args.run_dir), one_line=True))
    return 0


def add_cancel_parser(commands: Any) -> None:
    """Register ``cancel`` on the main CLI's subcommands."""
    about = ("End a run's current job (on Slurm the job now carrying it, an array task's own; on the local "
             "executor its processes) and record it as cancelled by the user, which status then says. Exit status "
             "2 when no job of the run is queued or running. See docs/operations.md.")
    parser = commands.add_parser("cancel", help="end a run's current job, recorded as cancelled by the user",
                                 description=about)
    parser.add_argument("run_dir", type=Path, metavar="RUN_DIR", help="the run folder, like runs/tiny-gpt")
    parser.set_defaults(run=_cancel)
