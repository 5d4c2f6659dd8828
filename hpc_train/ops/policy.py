"""The retry policy per failure class, and the run's list of excluded nodes.

Why per class: a retry pays off only when the next attempt can go differently. A broken node or a flaky fabric
goes away when the job lands elsewhere (so those retry, with the node excluded); a hang may be a stuck GPU or a
race (retried a little); a bug or a batch that does not fit fails the same way on any node (never retried, the
user has to change something). Preemption and time limits are not failures: the preemption path in
:mod:`hpc_train.train.preemption` requeues those, so :func:`decide` leaves them to it.

The exclusion list lives in the run folder (``excluded_nodes.json``), so it carries across attempts and
resubmissions of the run; :func:`exclude_expression` turns it into the value of ``sbatch --exclude``. Nothing here
calls Slurm: the requeue path does, with what :func:`decide` returns.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from hpc_train.distributed.hostlist import compress, expand
from hpc_train.errors import ConfigError
from hpc_train.ops.failures import CLASSES, Classification
from hpc_train.runfolder import atomic_write

__all__ = ["EXCLUDED_FILE", "Decision", "Exclusion", "RetryPolicy", "add_exclusions", "decide", "exclude_expression",
           "read_exclusions"]

EXCLUDED_FILE = "excluded_nodes.json"
_NODE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
_FAILURES = ("node_failure", "infrastructure", "hang", "unknown", "user_error", "out_of_memory")


@dataclass(frozen=True)
class RetryPolicy:
    """How often each class may be retried in one run (earlier failures of the same class count), and limits
    that stop a run which keeps failing for ever-new reasons."""

    max_node_failure: int = 3
    max_infrastructure: int = 3
    max_hang: int = 2
    max_unknown: int = 1
    max_total: int = 6  # failures of any class in one run
    max_excluded_nodes: int = 8  # more than this many bad nodes is not bad luck: stop and look
    exclude_hang_suspects: bool = False  # a hang's suspect node is often innocent (a deadlock in the code)

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> RetryPolicy:
        """The policy of a run's ``[retry]`` section (``hang``, ``node_failure``, ``infrastructure``: the resolved
        config in plan.json), the rest from the defaults."""
        retry = config.get("retry") or {}
        return cls(max_hang=int(retry.get("hang", cls.max_hang)),
                   max_node_failure=int(retry.get("node_failure", cls.max_node_failure)),
                   max_infrastructure=int(retry.get("infrastructure", cls.max_infrastructure)))

    def limit(self, failure_class: str) -> int:
        return {"node_failure": self.max_node_failure, "infrastructure": self.max_infrastructure,
                "hang": self.max_hang, "unknown": self.max_unknown}.get(failure_class, 0)


@dataclass(frozen=True)
class Decision:
    """What to do after an attempt ended: requeue or not, the nodes to add to the exclusion list, and why in one
    line. ``defer_to_preemption``: preempted / time limit, which the preemption requeue path handles."""

    retry: bool
    exclude_nodes: list[str] = field(default_factory=list)
    message: str = ""
    defer_to_preemption: bool = False


_NEVER = {
    "user_error": "fix the code or the config, then resubmit (the same error would come back on any node)",
    "out_of_memory": "lower train.micro_batch, raise zero.stage or offload, or ask for more memory "
                     "(python -m hpc_train validate --memory estimates it), then resubmit",
    "cancelled": "someone cancelled the job; resubmit to go on",
}


def decide(classification: Classification, attempts_so_far: Sequence[Classification | str], policy: RetryPolicy,
           *, excluded: Collection[str] = ()) -> Decision:
    """Whether to retry after ``classification``; pure.

    ``attempts_so_far``: the classes (or classifications) of the run's earlier failed attempts, this one not
    included; the retries of a class are counted from them. ``excluded``: nodes already on the run's exclusion
    list (:func:`read_exclusions`), which count against ``policy.max_excluded_nodes``.
    """
    kind = classification.failure_class
    if kind not in CLASSES:
        raise ValueError(f"unknown failure class {kind!r}; expected one of {', '.join(CLASSES)}")
    reason = classification.reason
    if kind == "completed":
        return Decision(False, [], "completed: nothing to retry")
    if kind in ("preempted", "time_limit"):
        return Decision(False, [], f"{reason}; the preemption path requeues it (preempt.requeue, "
                                   "preempt.max_requeues)", defer_to_preemption=True)
    if kind in _NEVER:
        return Decision(False, [], f"not retried: {reason}; {_NEVER[kind]}")
    earlier = [a.failure_class if isinstance(a, Classification) else str(a) for a in attempts_so_far]
    same = sum(1 for a in earlier if a == kind)
    failures = sum(1 for a in earlier if a in _FAILURES)
    limit = policy.limit(kind)
    name = kind.replace("_", " ")
    if same >= limit:
        return Decision(False, [], f"not retried: {reason}; {name} {same + 1} times, the policy allows {limit} "
                                   f"{'retry' if limit == 1 else 'retries'}")
    if failures >= policy.max_total:
        return Decision(False, [], f"not retried: {reason}; the run failed {failures + 1} times, the policy allows "
                                   f"{policy.max_total} retries in all")
    exclude: list[str] = []
    if kind in ("node_failure", "infrastructure") or (kind == "hang" and policy.exclude_hang_suspects):
        exclude = [node for node in dict.fromkeys(classification.nodes) if node not in set(excluded)]
    total = len(set(excluded) | set(exclude))
    if total > policy.max_excluded_nodes:
        return Decision(False, [], f"not retried: {reason}; that would exclude {total} nodes, the policy allows "
                                   f"{policy.max_excluded_nodes}: something larger than one node is wrong")
    counted = f"retry {same + 1} of {limit}"
    excluding = f", excluding {', '.join(exclude)}" if exclude else ""
    if kind in ("node_failure", "infrastructure") and not classification.nodes:
        excluding = ", no node to exclude (none was named)"
    return Decision(True, exclude, f"retried ({counted}{excluding}): {reason}")


# -- the exclusion list --------------------------------------------------------------------------------------


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
