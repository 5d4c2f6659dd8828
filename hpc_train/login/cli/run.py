"""``hpc_train run [FLAGS] SCRIPT_OR_MODULE:FN [ARGS...]``: a one-line launch, as torchrun and srun users type one.

No job file: the flags are keys of ``[job]`` (``--nodes 2`` is ``--set job.nodes=2``), the target is
``job.program`` and what follows it is ``job.args``; then it is ``submit`` (plan, validation, run folder,
follower, requeue, exit statuses). The run is named after the script or function (``train.py`` runs as
``runs/train``), so the same line run again resumes it, as ``submit`` does.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from hpc_train.config.checks import as_slurm_name
from hpc_train.errors import ConfigError

__all__ = ["add_run_parser", "run_overrides"]

SUMMARY = "run a script or a function on every rank without a job file: hpc_train run --nodes 2 train.py --lr 3e-4"
# (flag, [job] key): what torchrun's and srun's users pass as flags
_JOB_FLAGS = (("nodes", "nodes"), ("tasks_per_node", "tasks_per_node"), ("gpus_per_node", "gpus_per_node"),
              ("cpus_per_task", "cpus_per_task"), ("time", "time"), ("partition", "partition"),
              ("account", "account"), ("name", "name"))


def add_run_parser(commands: Any, run: Any) -> None:
    """Register ``run`` on the main CLI's subcommands; ``run`` is the function that submits a namespace."""
    parser = commands.add_parser("run", help=SUMMARY, description=SUMMARY + ". Arguments after the script go to "
                                 "it; see docs/your-own-code.md.")
    parser.add_argument("--site", default="local", help="site name or path to a site .toml (default: local)")
    parser.add_argument("--executor", choices=("auto", "slurm", "local"), default="auto",
                        help="auto: slurm when the site has Slurm and sbatch is on PATH, else local")
    for flag, key in _JOB_FLAGS:
        kind = str if key in ("time", "partition", "account", "name") else int
        parser.add_argument(f"--{flag.replace('_', '-')}", dest=key, type=kind, metavar="N" if kind is int else "V",
                            help=f"job.{key}")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="override any config value, typed like a job file (repeatable)")
    parser.add_argument("--dry-run", action="store_true", help="show everything, submit and write nothing")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON for machines")
    parser.add_argument("--no-follow", action="store_true", help="return once submitted instead of following")
    parser.add_argument("target", metavar="SCRIPT_OR_MODULE:FN",
                        help='a script ("train.py"), a file\'s function ("loop.py:main") or a module\'s '
                             '("package.module:main"); a function is called with ctx')
    parser.add_argument("args", nargs=argparse.REMAINDER, metavar="ARGS", help="the script's arguments")
    parser.set_defaults(run=lambda args: run(submit_namespace(args)))


def _run_name(target: str) -> str:
    """``train.py`` -> ``train``; ``loop.py:main`` -> ``loop-main``; ``pkg.mod:main`` -> ``mod-main``."""
    where, _, function = target.partition(":")
    stem = Path(where).stem if where.endswith(".py") else where.rpartition(".")[2]
    return as_slurm_name("-".join(part for part in (stem, function) if part), "run")


def run_overrides(args: argparse.Namespace) -> list[str]:
    """The ``--set`` list the flags mean: ``[job]`` keys, the program, its arguments, the name, then ``--set``."""
    if args.target.startswith("-"):
        raise ConfigError(args.target, "is a flag where the script or function belongs", "put hpc_train's flags "
                          "before the script: hpc_train run --nodes 2 train.py --lr 3e-4")
    overrides = [f"job.program={args.target}", f"job.args={json.dumps(list(args.args), ensure_ascii=False)}"]
    if args.name is None:
        overrides.append(f"job.name={_run_name(args.target)}")
    overrides += [f"job.{key}={getattr(args, key)}" for _, key in _JOB_FLAGS if getattr(args, key) is not None]
    return [*overrides, *args.overrides]


def submit_namespace(args: argparse.Namespace) -> argparse.Namespace:
    """What ``submit`` takes: no job file, the flags as overrides, no sweep."""
    return argparse.Namespace(config=None, site=args.site, executor=args.executor, overrides=run_overrides(args),
                              sweep=[], dry_run=args.dry_run, json=args.json, no_follow=args.no_follow,
                              debug=getattr(args, "debug", False))
