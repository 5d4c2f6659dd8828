"""Build plans and rendered scripts for tests from a job table and a site, without touching disk."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hpc_train.config.job import JobConfig
from hpc_train.config.loader import build
from hpc_train.config.plan import Plan, make_plan
from hpc_train.config.site import SiteConfig
from hpc_train.config.sites import load_site

FIXED_PYTHON = "/opt/venv/bin/python"
FIXED_CWD = Path("/scratch/project")


def golden_job(site: SiteConfig) -> dict[str, Any]:
    """Two nodes, one rank per GPU (two on CPU sites), tensor parallel inside the node."""
    per_node = site.node.gpus or 2
    return {"job": {"name": "golden", "nodes": 2, "tasks_per_node": per_node, "cpus_per_task": 1,
                    "time": "04:00:00"},
            "parallel": {"tensor": 2}, "env": {"HPC_TRAIN_EXAMPLE": "it's \"quoted\" $(not run)"}}


def plan_for(site_name: str, job: dict[str, Any] | None = None) -> Plan:
    site = load_site(site_name)
    cfg = build(JobConfig, job if job is not None else golden_job(site))
    return make_plan(cfg, site, "slurm", python=FIXED_PYTHON, cwd=FIXED_CWD)
