"""``python -m hpc_train.submit CONFIG --site SITE``: show the plan, submit it through submitit, follow it."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hpc_train.backends import executor_backend
from hpc_train.common.terminal import plain
from hpc_train.config.plan import Plan
from hpc_train.errors import ConfigError
from hpc_train.login.cli.common import (
    ArgumentParser,
    add_plan_arguments,
    plan_from_args,
    prepare_plan_folder,
    run_command,
)
from hpc_train.run.node_log import node_log_path

if TYPE_CHECKING:
    from hpc_train.login.slurm.follow import FollowedJob

__all__ = ["Submitted", "add_submit_arguments", "build_parser", "main", "run_submit", "submit_plans"]

SUMMARY = "show the plan, submit it (Slurm or the local executor) and follow it to the end"


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(prog="python -m hpc_train.submit", description=SUMMARY)
    add_submit_arguments(parser)
    return parser


def add_submit_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``python -m hpc_train.submit``, shared with ``hpc_train submit`` so the two cannot drift."""
    add_plan_arguments(parser)
    parser.add_argument("--sweep", action="append", default=[], metavar="SECTION.KEY=V1,V2",
                        help="submit one run per value as a job array (repeatable: every combination)")
    parser.add_argument("--dry-run", action="store_true", help="show everything, submit and write nothing")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON for machines")
    parser.add_argument("--no-follow", action="store_true", help="return once submitted instead of following")


def _plans(args: argparse.Namespace) -> list[Plan]:
    """The plan, or one plan per sweep combination; every one is validated before anything is submitted."""
    from hpc_train.login.cli.sweep import expand_sweeps, sweep_name

    base = plan_from_args(args)
    if not args.sweep:
        return [base]
    plans = []
    for index, combo in enumerate(expand_sweeps(args.sweep)):
        sweep_args = argparse.Namespace(**{**vars(args), "overrides": [*args.overrides, *combo,
                                                                        f"job.name={sweep_name(base.name, index)}"]})
        plans.append(plan_from_args(sweep_args, executor=base.executor))
    return plans


def _show(args: argparse.Namespace, plans: list[Plan]) -> None:
    from hpc_train.login.slurm.executors import submitit_parameters

    params = submitit_parameters(plans[0])
    if args.json:
        from hpc_train.login.cli.training import training_summary

        body = [json.loads(plan.to_json()) for plan in plans]
        training = [training_summary(plan).to_dict() for plan in plans]
        from hpc_train.common.terminal import print_json

        print_json({"plan": body[0] if len(body) == 1 else body, "submitit": params,
                    "training": training[0] if len(training) == 1 else training}, sort_keys=True)
        return
    from rich.console import Console

    from hpc_train.login.cli.summary import print_summary, print_sweep

    console = Console()
    print_summary(console, plans[0], f"submitit {plans[0].executor} executor parameters", params)
    if len(plans) > 1:
        print_sweep(console, plans, args.sweep)


def run_submit(args: argparse.Namespace) -> int:
    """Validate, show, submit and follow: the whole command, for both entry points."""
    plans = _plans(args)
    _show(args, plans)
    if args.dry_run:
        if not args.json:
            print("dry run: nothing submitted, nothing written")
        return 0
    from rich.console import Console
    from rich.text import Text

    from hpc_train.login.slurm.follow import follow
    from hpc_train.login.slurm.jobstate import check_slurm_available

    executor = plans[0].executor
    on_slurm = executor_backend(executor).on_slurm
    if on_slurm and not args.no_follow:
        check_slurm_available()
    console = Console(stderr=args.json, soft_wrap=True)  # job output lines are never re-wrapped
    os.umask(0o077)  # submitit's folder and the ranks' files stay private
    submitted = submit_plans(plans, tied=not args.no_follow)  # followed: it ends with this command
    for one in submitted:
        console.print(Text.assemble("submitted job ", (plain(one.job.job_id), "bold"), f" ({executor}); run folder ",
                                    plain(one.run_dir)))
    if args.no_follow:
        return 0
    followed = [one.followed() for one in submitted]
    try:
        with _hangup_as_interrupt(on_slurm):
            # Local jobs cost nothing to poll: back off to 1 s at most, so a laptop run ends when its ranks do.
            return follow(followed, executor, console, max_poll_s=5.0 if on_slurm else 1.0)
    except KeyboardInterrupt:
        ids = ",".join(job.job_id for job in followed)
        if on_slurm:
            console.print(f"stopped following; job {ids} keeps running: 'hpc_train cancel RUN_DIR' (or 'scancel "
                          f"{ids}') stops it, 'hpc_train status RUN_DIR' shows it")
            return 130
        from hpc_train.login.ops.cancel import cancel_local

        for job in followed:
            if not job.job.done():
                cancel_local(job.run_dir, int(job.job_id), "Ctrl-C to submit")
        console.print(f"stopped job {ids} with Ctrl-C: its ranks are ended and the attempt is recorded as cancelled "
                      "by the user; the same command resumes from the last checkpoint")
        return 130


@contextlib.contextmanager
def _hangup_as_interrupt(on_slurm: bool) -> Iterator[None]:
    """While a local job is followed, a closed terminal (SIGHUP) or a kill (SIGTERM) ends it as Ctrl-C does: its
    ranks lead a session of their own and would otherwise train on without anyone following."""
    if on_slurm:
        yield
        return
    import signal

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    caught = [number for number in (signal.SIGHUP, signal.SIGTERM) if signal.getsignal(number) is not signal.SIG_IGN]
    previous = {number: signal.signal(number, interrupt) for number in caught}  # nohup's ignored SIGHUP stays so
    try:
        yield
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)


@dataclass
class Submitted:
    """One submitted job (or array task) with its run folder, and where its rank-0 log stood at submission."""

    job: Any
    run_dir: Path
    plan: Plan
    log_offset: int

    def followed(self) -> FollowedJob:
        from hpc_train.login.slurm.follow import FollowedJob

        return FollowedJob(self.job, self.run_dir, label=self.run_dir.name, requeue=self.plan.requeue,
                           log_offset=self.log_offset, tasks_per_node=self.plan.resources.tasks_per_node)


def submit_plans(plans: list[Plan], before_submit: Callable[[list[Path]], None] | None = None,
                 tied: bool = False) -> list[Submitted]:
    """Prepare each plan's run folder, run ``before_submit`` on them, and submit: the command's and
    ``hpc_train.Executor``'s one way (``tied``: a local job ends with this process). A refusal (sbatch's, or a
    ConfigError) takes back what this submission wrote and is raised as a ConfigError naming the fix."""
    from hpc_train.login.cli.undo import Undo
    from hpc_train.login.slurm.executors import submit, submitit_folder

    if plans[0].backend.on_slurm:
        _refuse_busy_run_folders(plans)
    undo = Undo.record([*(Path(plan.run_dir) for plan in plans), submitit_folder(plans)],
                       roots=[Path(plans[0].run_dir).parent])
    try:
        run_dirs = [prepare_plan_folder(plan) for plan in plans]
        offsets = [_size(node_log_path(Path(run_dir), 0, plan.resources.tasks_per_node))  # follow only new lines
                   for run_dir, plan in zip(run_dirs, plans, strict=True)]
        if before_submit is not None:
            before_submit([Path(run_dir) for run_dir in run_dirs])
        jobs = submit(plans, tied)
    except Exception as error:  # sbatch said no (submitit's FailedJobError): bad partition, account, limits
        refused = type(error).__name__ in ("FailedJobError", "CalledProcessError")
        if refused or isinstance(error, ConfigError):
            undo.roll_back()  # nothing was submitted: what this submission wrote goes again
        if not refused:
            raise
        detail = [line for line in str(error).splitlines() if line.strip()]
        raise ConfigError("sbatch", "refused the job" + (f": {detail[-1].strip()}" if detail else ""),
                          "check the partition, account, QoS and limits (sinfo, sacctmgr show assoc)") from None
    return [Submitted(job, Path(run_dir), plan, offset)
            for job, run_dir, plan, offset in zip(jobs, run_dirs, plans, offsets, strict=True)]


# A job in these states is on its way out: its ranks have stopped writing, and the new job starts after it.
_ENDING = {"COMPLETING", "COMPLETED", "CANCELLED", "FAILED", "TIMEOUT", "NODE_FAIL", "BOOT_FAIL", "DEADLINE",
           "OUT_OF_MEMORY", "SPECIAL_EXIT", "PREEMPTED"}


def _refuse_busy_run_folders(plans: list[Plan]) -> None:
    """A run folder holds one job at a time: a second job would resume from the same checkpoints and write the
    same files as the first. One squeue call finds a queued or running job of this user in any of the folders;
    without squeue (or when it does not answer) nothing is refused."""
    import shutil
    import subprocess

    from hpc_train.backends.scheduler import TIMEOUT_S, parse_squeue, queue_matches, squeue_argv

    if shutil.which("squeue") is None:
        return
    try:
        result = subprocess.run(squeue_argv(), capture_output=True, text=True, timeout=TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return
    if result.returncode != 0:
        return
    queue = parse_squeue(result.stdout)
    for plan in plans:
        busy = [entry for entry in queue if queue_matches(entry, Path(plan.run_dir))
                and entry.state.split()[0].upper() not in _ENDING]
        if busy:
            entry = busy[0]
            raise ConfigError("job.name", f'run folder {plan.run_dir} is in use by job {entry.job_id} ({entry.state})',
                              f"wait for it to end, cancel it (scancel {entry.job_id}), or give this run another "
                              "job.name")


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return run_command(lambda: run_submit(args), debug=getattr(args, "debug", False))


if __name__ == "__main__":
    sys.exit(main())
