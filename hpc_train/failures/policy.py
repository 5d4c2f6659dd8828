"""The retry policy per failure class: retry or not, and which nodes to exclude.

Why per class: a retry pays off only when the next attempt can go differently. A broken node or a flaky fabric
goes away when the job lands elsewhere (so those retry, with the node excluded); a hang may be a stuck GPU or a
race (retried a little); a bug or a batch that does not fit fails the same way on any node (never retried, the
user has to change something). Preemption and time limits are not failures: the preemption path in
:mod:`hpc_train.rank.runtime.preemption` requeues those, so :func:`decide` leaves them to it.

The exclusion list itself (``excluded_nodes.json``) is part of the run folder's protocol:
:mod:`hpc_train.run.exclusions`. Nothing here calls Slurm: the requeue path does, with what :func:`decide` returns.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from hpc_train.failures.classify import CLASSES, Classification

if TYPE_CHECKING:
    from hpc_train.config.job import RetrySection

__all__ = ["Decision", "RetryPolicy", "decide"]

_FAILURES = ("node_failure", "infrastructure", "hang", "killed", "crashed", "unknown", "user_error", "out_of_memory")


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
    def from_section(cls, retry: RetrySection) -> RetryPolicy:
        """The policy of a run's ``[retry]`` section (``hang``, ``node_failure``, ``infrastructure``), the rest
        from the defaults."""
        return cls(max_hang=retry.hang, max_node_failure=retry.node_failure, max_infrastructure=retry.infrastructure)

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
    # The agent (hpc_train.rank.agent) restarts these inside the job within retry.in_place; what reaches the policy
    # has spent those restarts (or had them off), so nothing is left running in the job to retry it.
    "killed": "resubmit the same command to go on from the last checkpoint (the restarts inside the job, "
              "retry.in_place, were spent or off); if ranks keep being killed, ask the site what kills them (a "
              "node health agent, a memory limit outside the job)",
    "crashed": "python -m hpc_train logs RUN_DIR --rank N shows what the rank did last; resubmit the same command "
               "to go on from the last checkpoint (the restarts inside the job, retry.in_place, were spent or off)",
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
