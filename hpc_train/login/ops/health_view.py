"""A run's health checks as ``status`` shows them: rank 0's ``health.json`` (``hpc_train.rank.runtime.health``), read
without failing on a torn or missing file."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.text import Text

from hpc_train.common.terminal import plain, shown
from hpc_train.run.files import read_json_object
from hpc_train.run.paths import HEALTH_FILE

__all__ = ["health_cell", "health_lines", "read_findings"]

_FIELDS = ("check", "step", "figure", "threshold", "cause", "fix")


def read_findings(run_dir: Path) -> list[dict[str, Any]] | None:
    """The findings tripped now (each with its figure, threshold, cause and fix); None when the run has no
    health record yet (an older run, a program that is not the built-in trainer)."""
    data = read_json_object(Path(run_dir) / HEALTH_FILE)
    findings = data.get("findings")
    if not isinstance(findings, list):
        return None
    return [{key: finding.get(key) for key in _FIELDS} for finding in findings if isinstance(finding, dict)]


def health_cell(findings: list[dict[str, Any]] | None) -> Text:
    """The table's cell: ``ok``, the checks that tripped, or ``-`` without a record; a ``Text``, so that a check
    named ``[/]`` in a damaged ``health.json`` is shown as typed, never read as rich markup (a MarkupError)."""
    if findings is None:
        return shown("-")
    return shown(", ".join(str(f.get("check", "?")) for f in findings) if findings else "ok")


def health_lines(findings: list[dict[str, Any]] | None) -> list[str]:
    """One line per finding, under a single run's view."""
    return [plain(f"health: {f.get('check')} since step {f.get('step')}: {f.get('figure')} (threshold "
                  f"{f.get('threshold')}); likely {f.get('cause')}; fix: {f.get('fix')}") for f in findings or []]
