"""What every login-node command shares: the config/site/--set options, plan loading, and exit codes.

Exit status: 0 done, 1 a failure at run time, 2 a usage or configuration error (nothing submitted or written).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hpc_train.config.ds_import import imported_for, named_in_file
from hpc_train.config.loader import load_toml
from hpc_train.config.plan import Plan, load_job, make_plan
from hpc_train.config.sites import load_site
from hpc_train.errors import ConfigError
from hpc_train.terminal import plain

__all__ = ["EXIT_USAGE", "ArgumentParser", "add_plan_arguments", "plan_from_args",
           "prepare_plan_folder", "run_command"]

EXIT_USAGE = 2
EXIT_FAILURE = 1


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose usage errors follow our one-message, exit-2 rule, and where every command and subcommand
    takes ``--debug`` (read it with ``getattr(args, "debug", False)``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                          help="show the traceback of an unexpected failure")

    def error(self, message: str) -> None:  # type: ignore[override]
        self.print_usage(sys.stderr)
        print(f"error: {message}", file=sys.stderr)
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
    from hpc_train.slurm.executors import resolve_executor

    site = load_site(args.site)
    cfg = load_job(args.config, args.overrides)
    chosen = executor or resolve_executor(getattr(args, "executor", "auto"), site.slurm.enabled)
    try:
        return make_plan(cfg, site, chosen, config_dir=args.config.resolve().parent)
    except ConfigError as error:  # a check on a key that came from the job's ds_config.json names it there
        imported = imported_for(load_toml(args.config, "config"), args.config.resolve().parent) \
            if cfg.train.deepspeed_config else None
        raise named_in_file(error, imported) from None


def prepare_plan_folder(plan: Plan) -> Path:
    """Create (or reuse) the plan's run folder and write its plan and config into it
    (:func:`hpc_train.run.folder.prepare_run_folder`, which takes plain text so that it stays below the config)."""
    from hpc_train.config.tomlwrite import dumps
    from hpc_train.run.folder import prepare_run_folder

    return prepare_run_folder(plan.run_dir, plan.to_json(), dumps(dataclasses.asdict(plan.config)), plan.config_hash)


def run_command(command: Callable[[], int], debug: bool = False) -> int:
    """Run a command: a ConfigError becomes one message on stderr and exit status 2; anything unexpected one
    line naming it and the file that holds its traceback, and exit status 1 (the traceback itself on the
    terminal only with ``--debug``)."""
    try:
        return command()
    except ConfigError as error:
        print(f"error: {plain(error)}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
    except Exception as error:
        if debug:
            raise
        log = _crash_log()
        summary = plain(f"{type(error).__name__}: {error}")[:300]
        print(f"error: an unexpected failure ({summary}); its traceback is in {log or 'no file (unwritable)'}, and "
              "--debug shows it here", file=sys.stderr)
        return EXIT_FAILURE


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
