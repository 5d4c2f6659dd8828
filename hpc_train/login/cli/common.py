"""What every login-node command shares: the config/site/--set options, plan loading, and exit codes.

Exit status: 0 done, 1 a failure at run time, 2 a usage or configuration error (nothing submitted or written),
130 interrupted (Ctrl-C), 141 the reader of stdout left (``| head`` has what it wanted; nothing is said).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import select
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hpc_train.common.terminal import plain
from hpc_train.config.plan import Plan, load_job, make_plan
from hpc_train.config.sites import load_site
from hpc_train.errors import ConfigError

__all__ = ["EXIT_PIPE", "EXIT_USAGE", "ArgumentParser", "add_plan_arguments", "plan_from_args",
           "prepare_plan_folder", "run_command"]

EXIT_USAGE = 2
EXIT_FAILURE = 1
EXIT_PIPE = 128 + signal.SIGPIPE  # 141: the status a shell gives a program that SIGPIPE ended


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose usage errors follow our one-message, exit-2 rule, and where every command and subcommand
    takes ``--debug`` (read it with ``getattr(args, "debug", False)``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                          help="show the traceback of an unexpected failure")

    def error(self, message: str) -> None:  # type: ignore[override]
        """argparse's own messages quote what was typed (``unrecognized arguments: ...``, ``invalid choice: ...``):
        shown escaped and on one line, so an escape sequence pasted as an argument never reaches the terminal."""
        self.print_usage(sys.stderr)
        print(f"error: {plain(message, one_line=True)}", file=sys.stderr)
        raise SystemExit(EXIT_USAGE)


def add_plan_arguments(parser: argparse.ArgumentParser, executor: bool = True) -> None:
    parser.add_argument("config", type=Path, help="job config (TOML)")
    parser.add_argument("--site", default="local", help="site name or path to a site .toml (default: local)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="override one config value, typed like the file (repeatable)")
    if executor:
        parser.add_argument("--executor", choices=("auto", "slurm", "local"), default="auto",
                            help="auto: slurm when the site has Slurm and sbatch is on PATH, else local")


def plan_from_args(args: argparse.Namespace, executor: str | None = None) -> Plan:
    """Load the job and the site, apply overrides and validate everything.

    ``executor`` is used as given (render always plans for Slurm, wherever it runs); without it the
    ``--executor`` choice is resolved against this machine (is sbatch on PATH?).
    """
    from hpc_train.login.slurm.executors import resolve_executor

    site = load_site(args.site)
    cfg = load_job(args.config, args.overrides)  # config None: ``hpc_train run``, every key from the flags
    chosen = executor or resolve_executor(getattr(args, "executor", "auto"), site.slurm.enabled)
    folder = args.config.resolve().parent if args.config is not None else Path.cwd()
    return make_plan(cfg, site, chosen, config_dir=folder)  # names ds_config.json's keys


def prepare_plan_folder(plan: Plan) -> Path:
    """Create (or reuse) the plan's run folder and write its plan and config into it
    (:func:`hpc_train.run.folder.prepare_run_folder`, which takes plain text so that it stays below the config)."""
    from hpc_train.config.tomlwrite import dumps
    from hpc_train.run.folder import prepare_run_folder

    return prepare_run_folder(plan.run_dir, plan.to_json(), dumps(dataclasses.asdict(plan.config)), plan.config_hash)


def run_command(command: Callable[[], int], debug: bool = False) -> int:
    """Run a command: a ConfigError becomes one message on stderr and exit status 2; anything unexpected one
    line naming it and the file that holds its traceback, and exit status 1 (the traceback itself on the
    terminal only with ``--debug``); a reader of stdout that left ends it quietly (:func:`_reader_left`)."""
    try:
        code = command()
        sys.stdout.flush()  # a reader that left shows here, not in the interpreter's last flush at exit
        return code
    except ConfigError as error:
        print(f"error: {plain(error, one_line=True)}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        if not _stdout_reader_gone():  # a pipe of our own (a subprocess, a socket) broke: that is a failure
            return _unexpected(debug)
        return _reader_left()
    except SystemExit as exit_:  # rich's Console.on_broken_pipe: stdout already on /dev/null, SystemExit(1)
        if exit_.code == EXIT_FAILURE and isinstance(exit_.__context__, BrokenPipeError):
            return _reader_left()
        raise
    except Exception:
        return _unexpected(debug)


def _unexpected(debug: bool) -> int:
    """One line naming the exception in flight and the private file that holds its traceback; exit status 1."""
    if debug:
        raise  # the exception being handled: always called inside an except block
    error = sys.exc_info()[1]
    log = _crash_log()
    summary = plain(f"{type(error).__name__}: {error}", one_line=True)[:300]
    print(f"error: an unexpected failure ({summary}); its traceback is in {log or 'no file (unwritable)'}, and "
          "--debug shows it here", file=sys.stderr)
    return EXIT_FAILURE


def _stdout_reader_gone() -> bool:
    """Whether stdout is a pipe (or socket) whose reader has closed it: poll says POLLERR or POLLHUP for it. A
    BrokenPipeError from anything else is a real failure and is reported as one."""
    try:
        descriptor = sys.stdout.fileno()
        poller = select.poll()
        poller.register(descriptor, select.POLLOUT)
        events = poller.poll(0)
    except (AttributeError, OSError, ValueError):  # no real stdout (captured in a test), or no poll
        return False
    return any(mask & (select.POLLERR | select.POLLHUP) for _, mask in events)


def _reader_left() -> int:
    """End quietly, as coreutils end when the reader of their output leaves (``hpc_train status --json | head``):
    no message, no error file, and exit status 141, which is what a shell reports for ``yes | head`` (128 +
    SIGPIPE) and what a ``set -o pipefail`` script already knows to expect from any tool in a pipe.

    Why not ``python -m json.tool``'s way: it exits with the errno (32), which a shell reads as a plain failure.
    Why not the signal itself: the CLI also runs in-process (tests, the console command), where restoring
    SIGPIPE's default would kill the caller. stdout is pointed at /dev/null so that the interpreter's last flush
    at exit finds a writable file and says nothing ("Exception ignored ... BrokenPipeError")."""
    with contextlib.suppress(AttributeError, OSError, ValueError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    return EXIT_PIPE


def _crash_log() -> str:
    """The current traceback in a new private file of the temporary folder (never through a link)."""
    import tempfile
    import traceback

    try:
        descriptor, name = tempfile.mkstemp(prefix="hpc_train-error-", suffix=".log")
        with os.fdopen(descriptor, "w", encoding="utf-8") as handle:
            handle.write(traceback.format_exc())
    except OSError:
        return ""
    return name
