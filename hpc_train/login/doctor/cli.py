"""``python -m hpc_train doctor``: is this cluster ready for the job? Slurm, the partition's limits, this node's
fabric, the NCCL environment, and a probe job that proves the preemption signal reaches every rank and the run
folder's root is shared by every node. Each finding comes with a severity and a one-line fix.

Without --config only the site is checked (the probe then runs --nodes x --ntasks-per-node, default 2 x 1).
Runs on a login node or inside a job; never imports torch or DeepSpeed.
Exit status: 0 no error found; 1 at least one error finding; 2 bad input (config, site, options).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from hpc_train.login.doctor.defaults import DEFAULT_PROBE_NODES, DEFAULT_PROBE_TIMEOUT_S

__all__ = ["add_parser"]


def _run(args: argparse.Namespace) -> int:
    """The checks live in .run: registering the command must cost every other command nothing."""
    from hpc_train.login.doctor.run import run_doctor

    return run_doctor(args)


def add_parser(commands: Any) -> None:
    """Register ``doctor`` on the main CLI's subcommands."""
    doctor = commands.add_parser("doctor", help="check Slurm, partition limits, fabric, NCCL, signal delivery",
                                 description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    doctor.add_argument("--config", type=Path, metavar="PATH", help="job config (TOML) to check; without it, the "
                        "site alone")
    doctor.add_argument("--site", default="local", help="site name or path to a site .toml (default: local)")
    doctor.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="override one config value, typed like the file (repeatable; needs --config)")
    doctor.add_argument("--json", action="store_true", help="print one JSON document instead of tables")
    doctor.add_argument("--no-probe", action="store_true", help="do not submit the signal-delivery probe job")
    doctor.add_argument("--probe-timeout", type=float, default=DEFAULT_PROBE_TIMEOUT_S, metavar="SECONDS",
                        help=f"how long the probe job may take to start and report (default "
                             f"{DEFAULT_PROBE_TIMEOUT_S:.0f})")
    doctor.add_argument("--nodes", type=int, metavar="N", help=f"probe job nodes (default: the job's, else "
                        f"{DEFAULT_PROBE_NODES})")
    doctor.add_argument("--ntasks-per-node", type=int, metavar="N", help="probe tasks per node (default: the "
                        "job's, else 1)")
    doctor.add_argument("--sysfs", default="/sys", metavar="ROOT", help="sysfs root to read the fabric from "
                        "(default: /sys)")
    doctor.set_defaults(run=_run)
