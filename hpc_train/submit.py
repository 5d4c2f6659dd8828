"""``python -m hpc_train.submit CONFIG --site SITE``: show the plan, then submit it through submitit."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from hpc_train.cli.common import ArgumentParser, add_plan_arguments, plan_from_args, run_command

__all__ = ["build_parser", "main"]


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(prog="python -m hpc_train.submit", description=__doc__)
    add_plan_arguments(parser)
    parser.add_argument("--dry-run", action="store_true", help="show everything, submit and write nothing")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON for machines")
    parser.add_argument("--no-follow", action="store_true", help="return once submitted instead of following")
    return parser


def _submit(argv: list[str] | None) -> int:
    args = build_parser().parse_args(argv)
    plan = plan_from_args(args)
    from hpc_train.slurm.executors import submitit_parameters

    params = submitit_parameters(plan)
    if args.json:
        print(json.dumps({"plan": json.loads(plan.to_json()), "submitit": params}, indent=2, sort_keys=True))
    else:
        from rich.console import Console

        from hpc_train.cli.summary import print_summary

        print_summary(Console(), plan, f"submitit {plan.executor} executor parameters", params)
    if args.dry_run:
        if not args.json:
            print("dry run: nothing submitted, nothing written")
        return 0
    from rich.console import Console

    from hpc_train.runfolder import prepare_run_folder
    from hpc_train.slurm.executors import submit
    from hpc_train.slurm.follow import follow

    console = Console(stderr=args.json)
    os.umask(0o077)  # submitit's folder and the ranks' files stay private
    run_dir = prepare_run_folder(plan)
    job = submit(plan)
    console.print(f"submitted job [bold]{job.job_id}[/] ({plan.executor}); run folder {run_dir}")
    if args.no_follow:
        return 0
    return follow(job, Path(run_dir), console)


def main(argv: list[str] | None = None) -> int:
    return run_command(lambda: _submit(argv))


if __name__ == "__main__":
    sys.exit(main())
