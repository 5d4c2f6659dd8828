"""Rank 0's exporters of ``[monitor]`` (W&B, Prometheus), built from the plan: the monitor hands each every
metrics.jsonl record and closes them with itself, so the trainer and ``ctx.log`` programs export alike."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Protocol

from hpc_train.config.plan import Plan
from hpc_train.run.node import node_name

__all__ = ["Exporter", "build_exporters"]


class Exporter(Protocol):
    """Takes metrics.jsonl records as they are written; must never raise (a failure is its own warning)."""

    def record(self, record: Mapping[str, Any]) -> None: ...

    def close(self) -> None: ...


def build_exporters(plan: Plan, run_dir: Path, log: Callable[[str], None]) -> list[Exporter]:
    """The exporters ``[monitor]`` turns on (none by default); call on rank 0 only."""
    monitor = plan.config.monitor
    exporters: list[Exporter] = []
    if monitor.prometheus:
        from hpc_train.rank.runtime.export_prometheus import PrometheusExporter

        labels = {"run": Path(run_dir).name, "job_id": os.environ.get("SLURM_JOB_ID", "local"), "node": node_name()}
        folder = Path(plan.prometheus_dir) if plan.prometheus_dir else Path(run_dir)
        exporters.append(PrometheusExporter(folder, run_dir, labels, log))
    if monitor.wandb:
        from hpc_train.rank.runtime.export_wandb import WandbExporter

        config = dataclasses.asdict(plan.config)
        config.pop("env", None)  # values of the job's [env] stay out of a third-party service
        exporters.append(WandbExporter(run_dir, monitor.wandb, monitor.wandb_project, monitor.wandb_entity,
                                       plan.name, config, log))
    return exporters
