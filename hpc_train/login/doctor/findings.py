"""One finding per thing doctor checked: what it saw, how bad it is, and the one-line fix."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any, Literal

__all__ = ["SEVERITIES", "Finding", "Severity", "exit_status", "summary"]

Severity = Literal["ok", "info", "warning", "error"]
# Mildest first; an "error" means the job cannot run (or would hang) as configured.
SEVERITIES: tuple[Severity, ...] = ("ok", "info", "warning", "error")


@dataclass(frozen=True)
class Finding:
    """``check`` names the area (slurm, partition, fabric, nccl, probe, run folder); ``fix`` is empty when ok."""

    check: str
    severity: Severity
    message: str
    fix: str = ""

    def __post_init__(self) -> None:
        if self.severity not in SEVERITIES:  # a programming error, never user input
            raise ValueError(f"unknown severity {self.severity!r}")

    @property
    def is_error(self) -> bool:
        return self.severity == "error"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def exit_status(findings: Iterable[Finding]) -> int:
    """0 when nothing is an error, 1 otherwise (2, bad input, never gets this far)."""
    return 1 if any(f.is_error for f in findings) else 0


def summary(findings: Iterable[Finding]) -> str:
    """``"1 error, 2 warnings, 5 ok"``: the line under the table, worst first."""
    counts = Counter(f.severity for f in findings)
    parts = []
    for severity in reversed(SEVERITIES):
        count = counts.get(severity, 0)
        if count:
            plural = "s" if count != 1 and severity in ("error", "warning") else ""
            parts.append(f"{count} {severity}{plural}")
    return ", ".join(parts) or "nothing checked"
