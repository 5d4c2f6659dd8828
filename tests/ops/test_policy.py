"""The retry policy per class, and the run folder's exclusion list."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest

from hpc_train.errors import ConfigError
from hpc_train.ops.failures import Classification
from hpc_train.ops.policy import (
    EXCLUDED_FILE,
    Decision,
    RetryPolicy,
    add_exclusions,
    decide,
    exclude_expression,
    read_exclusions,
)

POLICY = RetryPolicy()


def _c(kind: str, nodes: tuple[str, ...] = (), reason: str = "") -> Classification:
    return Classification(kind, reason or f"{kind.replace('_', ' ')}: something", nodes=nodes, job_id="42")


@pytest.mark.parametrize("kind", ["user_error", "out_of_memory", "cancelled"])
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
    policy = RetryPolicy.from_config({"retry": {"hang": 5, "node_failure": 1, "infrastructure": 0}})
    assert (policy.max_hang, policy.max_node_failure, policy.max_infrastructure) == (5, 1, 0)
    assert RetryPolicy.from_config({}) == RetryPolicy()
    assert not decide(_c("infrastructure", ("n1",)), [], policy).retry


def test_exclusion_list_round_trip(tmp_path: Path) -> None:
    assert read_exclusions(tmp_path) == []
    listed = add_exclusions(tmp_path, ["n2"], "node_failure", "800", "node failure on n2", now=100.0)
    assert [(e.node, e.failure_class, e.job_id, e.time) for e in listed] == [("n2", "node_failure", "800", 100.0)]
    listed = add_exclusions(tmp_path, ["n2", "n10", "n3"], "infrastructure", "801", "ECC", now=200.0)
    assert [e.node for e in listed] == ["n2", "n10", "n3"] and listed[0].job_id == "800"  # first entry kept
    assert read_exclusions(tmp_path) == listed
    path = tmp_path / EXCLUDED_FILE
    data = json.loads(path.read_text())
    assert data["nodes"][1] == {"node": "n10", "class": "infrastructure", "job_id": "801", "time": 200.0,
                                "reason": "ECC"}
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert not list(tmp_path.glob(".*tmp*"))  # written through a temporary file, renamed
    assert exclude_expression(listed) == "n[2-3,10]"
    assert exclude_expression(listed, also="gpu[001-002]") == "gpu[001-002],n[2-3,10]"
    assert exclude_expression([]) == ""


def test_a_hand_broken_exclusion_file_names_itself(tmp_path: Path) -> None:
    path = tmp_path / EXCLUDED_FILE
    path.write_text("{not json")
    with pytest.raises(ConfigError, match=EXCLUDED_FILE):
        read_exclusions(tmp_path)
    path.write_text(json.dumps({"nodes": [{"node": "n1,n2"}]}))
    with pytest.raises(ConfigError, match="names no node"):
        read_exclusions(tmp_path)
    path.write_text("[]")
    with pytest.raises(ConfigError, match='no "nodes" list'):
        read_exclusions(tmp_path)


def test_add_refuses_what_is_not_a_node_name(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not a node name"):
        add_exclusions(tmp_path, ["n[1-2]"], "node_failure", "1", "x")
    assert not (tmp_path / EXCLUDED_FILE).exists()
