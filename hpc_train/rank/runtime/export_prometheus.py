"""Prometheus, without an open port: the run's latest scalars and health flags in the text exposition format, for
node_exporter's textfile collector (``--collector.textfile.directory``).

Why a file and not an endpoint or a push gateway: compute nodes seldom accept scrapes from outside, and a push
gateway keeps a dead run's last values for ever. node_exporter already runs on most clusters' nodes, and a
``.prom`` file in its folder is scraped with the node's other metrics. The file is rewritten whole (temporary
name, rename), so the collector never reads half of it; the folder is the site's ``prometheus_dir`` or the run
folder, and a folder reached through a link is refused like any run folder.

Plain Python, no torch, no prometheus_client (the tests parse the file with prometheus_client's own parser).
"""

from __future__ import annotations

import json
import math
import re
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from hpc_train.run.files import MAX_RECORD_FILE, atomic_write, open_record
from hpc_train.run.paths import HEALTH_FILE

__all__ = ["HEALTH_CHECKS", "PrometheusExporter", "exposition"]

HEALTH_CHECKS = ("data_wait", "comm", "loss", "memory_growth", "straggler", "gpu_utilisation", "gpu_memory")
# The file is rewritten at most this often (and at close, with the last values): each rewrite is 4 metadata operations
# (create, chmod, rename, the folder's fsync) and a read of health.json, on a shared file system when the folder is
# the run folder; node_exporter is scraped every 15-60 s, so a faster rewrite shows nothing more.
_MIN_INTERVAL_S = 15.0

# metrics.jsonl key -> (metric name, help)
_KNOWN = {
    "step": ("hpc_train_step", "The latest logged optimizer step."),
    "loss": ("hpc_train_loss", "Training loss at the latest logged step."),
    "eval_loss": ("hpc_train_eval_loss", "The latest evaluation loss."),
    "lr": ("hpc_train_learning_rate", "Learning rate at the latest logged step."),
    "grad_norm": ("hpc_train_grad_norm", "Global gradient norm at the latest logged step."),
    "tokens_per_s": ("hpc_train_tokens_per_second", "Tokens per second since the previous logged step."),
    "mfu": ("hpc_train_mfu_ratio", "Model FLOPs utilisation (0.42 = 42 %)."),
    "step_time_s": ("hpc_train_step_seconds", "Mean step time since the previous logged step."),
    "memory_bytes": ("hpc_train_memory_bytes", "Peak memory of rank 0 (GPU allocated, else resident)."),
}
_PHASE = re.compile(r"(data|forward|backward|optimizer|comm)_(ms|share)")
_LABEL_NAME = re.compile(r"[^A-Za-z0-9_]")


def _label_value(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _number(value: float) -> str:
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value))


def exposition(labels: Mapping[str, str], values: Mapping[str, float], health: Mapping[str, bool],
               updated: float) -> str:
    """The text exposition of one run: ``values`` are metrics.jsonl keys (the breakdown's, ctx.log's own names
    too), ``health`` each check's flag."""
    base = ",".join(f'{name}="{_label_value(value)}"' for name, value in labels.items())
    families: dict[str, tuple[str, list[str]]] = {}

    def add(metric: str, help_text: str, extra: str, value: float) -> None:
        inner = ",".join(part for part in (base, extra) if part)
        families.setdefault(metric, (help_text, []))[1].append(f"{metric}{{{inner}}} {_number(value)}")

    for key, value in sorted(values.items()):
        if key in _KNOWN:
            metric, help_text = _KNOWN[key]
            add(metric, help_text, "", value)
        elif match := _PHASE.fullmatch(key):
            phase, unit = match.groups()
            if unit == "ms":
                add("hpc_train_step_phase_seconds", "Mean time of each phase of a step on rank 0 (comm: exposed "
                    "communication).", f'phase="{phase}"', value / 1000)
            else:
                add("hpc_train_step_phase_ratio", "Each phase's share of the step on rank 0.", f'phase="{phase}"',
                    value)
        elif not key.startswith(tuple(f"{p}_ms_" for p in ("data", "forward", "backward", "optimizer", "comm"))):
            add("hpc_train_metric", "A scalar the program logged (ctx.log), by name.",
                f'name="{_label_value(key)}"', value)
    for check in sorted(health):
        add("hpc_train_health_flag", "1 while a health check is tripped (status and health.json say why).",
            f'check="{_label_value(check)}"', 1.0 if health[check] else 0.0)
    add("hpc_train_last_update_timestamp_seconds", "When the run last wrote this file (a stale value: the run "
        "is gone).", "", updated)
    lines: list[str] = []
    for metric, (help_text, samples) in families.items():
        lines += [f"# HELP {metric} {help_text}", f"# TYPE {metric} gauge", *samples]
    return "\n".join(lines) + "\n"


class PrometheusExporter:
    """Rank 0's ``.prom`` file for one run, rewritten as records come (at most every 15 s) and at close."""

    def __init__(self, folder: Path, run_dir: Path, labels: Mapping[str, str], log: Callable[[str], None]) -> None:
        self.folder, self.run_dir, self.labels, self.log = Path(folder), Path(run_dir), dict(labels), log
        name = _LABEL_NAME.sub("_", self.labels.get("run", "run"))[:100]
        self.path = self.folder / f"hpc_train_{name}.prom"
        self.values: dict[str, float] = {}
        self._written = 0.0
        self._failed = False
        if self.folder.is_symlink() or not self.folder.is_dir():
            self._fail(f"{self.folder} is not a folder (or is reached through a link)")

    def record(self, record: Mapping[str, Any]) -> None:
        """A metrics.jsonl record: its numbers become the latest values."""
        for key, value in record.items():
            if key != "time" and isinstance(value, int | float) and not isinstance(value, bool):
                self.values[key] = float(value)
        if time.monotonic() - self._written >= _MIN_INTERVAL_S:
            self.write()

    def write(self) -> None:
        if self._failed:
            return
        try:
            atomic_write(self.path, exposition(self.labels, self.values, self._health(), time.time()), mode=0o644)
        except OSError as error:
            self._fail(f"cannot write {self.path}: {error.strerror or error}")
        self._written = time.monotonic()

    def close(self) -> None:
        self.write()

    def _health(self) -> dict[str, bool]:
        tripped: set[str] = set()
        try:
            with open_record(self.run_dir / HEALTH_FILE) as handle:
                data = json.loads(handle.read(MAX_RECORD_FILE))
            tripped = {str(f.get("check")) for f in data.get("findings", []) if isinstance(f, dict)}
        except (OSError, ValueError, AttributeError):
            pass  # no findings yet (or a damaged file: the flags read clear)
        return {check: check in tripped for check in (*HEALTH_CHECKS, *sorted(tripped - set(HEALTH_CHECKS)))}

    def _fail(self, why: str) -> None:
        self._failed = True
        self.log(f"warning: prometheus: {why}; the run goes on without its .prom file (the folder is the site's "
                 "prometheus_dir, else the run folder)")
