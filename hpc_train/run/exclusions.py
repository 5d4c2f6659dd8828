"""``RUN_DIR/excluded_nodes.json``: the nodes a run keeps out of its later attempts, and why.

The list lives in the run folder, so it carries across attempts and resubmissions of the run: the requeue path
writes it (:func:`add_exclusions`), and the next submission reads it into ``sbatch --exclude``
(:func:`exclude_expression`). Plain JSON and host lists, no Slurm calls: the login node reads it.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

from hpc_train.distributed.hostlist import compress, expand  # pure standard library
from hpc_train.errors import ConfigError
from hpc_train.run.files import atomic_write
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
    """The run's excluded nodes (none when the file does not exist); ConfigError naming the file when it is not
    what :func:`add_exclusions` writes (someone edited it by hand)."""
    path = Path(run_dir) / EXCLUDED_FILE
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return []
    except (OSError, ValueError) as error:
        raise ConfigError(str(path), f"cannot be read ({error})", "fix the JSON or delete the file to exclude no "
                          "node") from None
    entries = data.get("nodes") if isinstance(data, dict) else None
    if not isinstance(entries, list):
        raise ConfigError(str(path), 'has no "nodes" list', 'write {"nodes": []} or delete the file')
    found = []
    for entry in entries:
        node = entry.get("node") if isinstance(entry, dict) else None
        if not isinstance(node, str) or not _NODE.fullmatch(node):
            raise ConfigError(str(path), f"holds {entry!r}, which names no node",
                              'give each entry a "node" like "gpu017", or delete the entry')
        found.append(Exclusion(node, str(entry.get("class", "")), str(entry.get("job_id", "")),
                               float(entry.get("time", 0) or 0), str(entry.get("reason", ""))))
    return found


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
    return tuple(int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name))
