"""The retry policy per class."""

from __future__ import annotations

import pytest

from hpc_train.config.job import RetrySection
from hpc_train.failures.classify import Classification
from hpc_train.failures.policy import Decision, RetryPolicy, decide

POLICY = RetryPolicy()


def _c(kind: str, nodes: tuple[str, ...] = (), reason: str = "") -> Classification:
    return Classification(kind, reason or f"{kind.replace('_', ' ')}: something", nodes=nodes, job_id="42")


@pytest.mark.parametrize("kind", ["user_error", "out_of_memory", "cancelled", "killed", "crashed"])
def test_never_retried_and_says_what_to_do(kind: str) -> None:
    decision = decide(_c(kind, ("n1",)), [], POLICY)
    assert decision == Decision(False, [], decision.message)
    assert decision.message.startswith("not retried: ") and "resubmit" in decision.message
    assert "\n" not in decision.message


@pytest.mark.parametrize("kind", ["preempted", "time_limit"])
def test_preemption_and_time_limits_are_left_to_the_preemption_path(kind: str) -> None:
    decision = decide(_c(kind), [], POLICY)
    assert not decision.retry and decision.defer_to_preemption and "preempt.max_requeues" in decision.message


def test_completed_is_not_retried() -> None:
    assert decide(_c("completed"), [], POLICY).retry is False


def test_node_failures_retry_with_the_node_excluded_up_to_the_limit() -> None:
    first = decide(_c("node_failure", ("n2",), "node failure: Slurm lost a node on n2"), [], POLICY)
    assert first.retry and first.exclude_nodes == ["n2"]
    assert first.message == "retried (retry 1 of 3, excluding n2): node failure: Slurm lost a node on n2"
    earlier = ["node_failure", "preempted", _c("node_failure"), "node_failure"]
    last = decide(_c("node_failure", ("n3",)), earlier, POLICY)
    assert not last.retry and "node failure 4 times, the policy allows 3 retries" in last.message


def test_infrastructure_excludes_only_new_nodes_and_says_when_none_is_named() -> None:
    decision = decide(_c("infrastructure", ("n1", "n2")), [], POLICY, excluded=["n1"])
    assert decision.retry and decision.exclude_nodes == ["n2"]
    unnamed = decide(_c("infrastructure"), [], POLICY)
    assert unnamed.retry and unnamed.exclude_nodes == [] and "no node to exclude" in unnamed.message


def test_hangs_retry_without_exclusion_unless_asked() -> None:
    assert decide(_c("hang", ("n2",)), [], POLICY).exclude_nodes == []
    assert decide(_c("hang", ("n2",)), [], RetryPolicy(exclude_hang_suspects=True)).exclude_nodes == ["n2"]
    assert not decide(_c("hang"), ["hang", "hang"], POLICY).retry


def test_unknown_is_retried_once() -> None:
    assert decide(_c("unknown"), [], POLICY).retry
    decision = decide(_c("unknown"), ["unknown"], POLICY)
    assert not decision.retry and "allows 1 retry" in decision.message


def test_limits_over_all_classes_and_excluded_nodes() -> None:
    many = ["hang", "unknown", "node_failure", "node_failure", "infrastructure", "infrastructure"]
    assert not decide(_c("infrastructure", ("n9",)), many, POLICY).retry
    crowded = decide(_c("node_failure", ("n9",)), [], RetryPolicy(max_excluded_nodes=2), excluded=["n1", "n2"])
    assert not crowded.retry and "something larger than one node" in crowded.message


def test_unknown_class_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown failure class"):
        decide(_c("gremlins"), [], POLICY)


def test_policy_from_the_runs_retry_section() -> None:
    policy = RetryPolicy.from_section(RetrySection(hang=5, node_failure=1, infrastructure=0))
    assert (policy.max_hang, policy.max_node_failure, policy.max_infrastructure) == (5, 1, 0)
    assert RetryPolicy.from_section(RetrySection()) == RetryPolicy()
    assert not decide(_c("infrastructure", ("n1",)), [], policy).retry
