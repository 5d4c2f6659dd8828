"""``RUN_DIR/excluded_nodes.json``: the nodes a run keeps out of its later attempts, and why.

The list lives in the run folder, so it carries across attempts and resubmissions of the run: the requeue path
writes it (:func:`add_exclusions`), and the next submission reads it into ``sbatch --exclude``
(:func:`exclude_expression`). Plain JSON and host lists, no Slurm calls: the login node reads it.
"""

from __future__ import annotations

import json
import math
import re
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

from hpc_train.common.hostlist import compress, expand  # pure standard library
from hpc_train.run.files import atomic_write, parse_json, read_record_text, warn_bad_record
from hpc_train.run.paths import EXCLUDED_FILE

__all__ = ["Exclusion", "add_exclusions", "exclude_expression", "read_exclusions"]

_NODE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


@dataclass(frozen=True)
class Exclusion:
    """One node kept out of the run's later attempts, and why."""

    node: str
    failure_class: str
    job_id: str
    time: float
    reason: str

    def to_dict(self) -> dict[str, object]:
        data = asdict(self)
        return {"class": data.pop("failure_class"), **data}


def read_exclusions(run_dir: Path) -> list[Exclusion]:
    """The run's excluded nodes (none when the file does not exist). What is not what :func:`add_exclusions`
    writes (someone edited it by hand, or it is torn) is skipped with a warning naming the file: a broken list
    must not stop a submission or a status, and the next requeue rewrites it whole."""
    path = Path(run_dir) / EXCLUDED_FILE
    text = read_record_text(path)
    if not text:
        return []
    try:
        data = parse_json(text)  # a number no float holds (a 400-digit time) is damage, never an OverflowError
    except ValueError as error:
        warn_bad_record(path, None, f"is not JSON ({str(error)[:80]})")
        return []
    entries = data.get("nodes") if isinstance(data, dict) else None
    if not isinstance(entries, list):
        warn_bad_record(path, None, 'has no "nodes" list')
        return []
    found = []
    for index, entry in enumerate(entries):
        try:
            found.append(_exclusion(entry))
        except ValueError as error:
            warn_bad_record(path, None, f"entry {index} {error}")
    return found


def _exclusion(entry: object) -> Exclusion:
    node = entry.get("node") if isinstance(entry, dict) else None
    if not isinstance(entry, dict) or not isinstance(node, str) or not _NODE.fullmatch(node):
        raise ValueError(f"({str(entry)[:60]}) names no node")
    stamp = entry.get("time", 0) or 0
    if isinstance(stamp, bool) or not isinstance(stamp, int | float) or not math.isfinite(stamp):
        raise ValueError(f"has the time {str(stamp)[:30]!r}, not a number")
    return Exclusion(node, str(entry.get("class", ""))[:64], str(entry.get("job_id", ""))[:64], float(stamp),
                     str(entry.get("reason", ""))[:500])


def add_exclusions(run_dir: Path, nodes: Iterable[str], failure_class: str, job_id: str, reason: str,
                   now: float | None = None) -> list[Exclusion]:
    """Add ``nodes`` to the run's exclusion list (a node already on it keeps its first entry) and return the
    whole list. Written atomically: a crash leaves the old list or the new one."""
    current = read_exclusions(run_dir)
    listed = {e.node for e in current}
    stamp = time.time() if now is None else now
    for node in dict.fromkeys(nodes):
        if not _NODE.fullmatch(node):
            raise ValueError(f"not a node name: {node!r}")
        if node not in listed:
            current.append(Exclusion(node, failure_class, job_id, stamp, reason))
            listed.add(node)
    text = json.dumps({"nodes": [e.to_dict() for e in current]}, indent=2) + "\n"
    atomic_write(Path(run_dir) / EXCLUDED_FILE, text)
    return current


def exclude_expression(nodes: Iterable[Exclusion | str], also: str = "") -> str:
    """The value of ``--exclude``: the nodes (and ``also``, e.g. the site's own exclude list) as one compressed
    Slurm host list in natural order (``gpu[001-003,017]``); ``""`` when there is nothing to exclude."""
    names = [n.node if isinstance(n, Exclusion) else n for n in nodes]
    if also:
        names += expand(also)
    unique = sorted(set(names), key=_natural)
    return compress(unique) if unique else ""


def _natural(name: str) -> tuple[object, ...]:
    return tuple(int(part) if (part.isascii() and part.isdigit()) else part for part in re.split(r"([0-9]+)", name))
