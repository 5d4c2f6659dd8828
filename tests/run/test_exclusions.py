"""The run folder's exclusion list (``excluded_nodes.json``) and the ``--exclude`` value it becomes."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest

from hpc_train.run.exclusions import add_exclusions, exclude_expression, read_exclusions
from hpc_train.run.paths import EXCLUDED_FILE


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


@pytest.mark.parametrize(("text", "said"), [
    ("{not json", "is not JSON"), (json.dumps({"nodes": [{"node": "n1,n2"}, {"node": "n3"}]}), "names no node"),
    ("[]", 'no "nodes" list'), (json.dumps({"nodes": [{"node": "n3", "time": "noon"}]}), "'noon', not a number"),
    (json.dumps({"nodes": "x"}), 'no "nodes" list'), ("[" * 100000, "is not JSON"), ("\udcff\x00", "is not JSON"),
])
def test_a_hand_broken_exclusion_file_is_skipped_with_a_warning_naming_it(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, said: str) -> None:
    (tmp_path / EXCLUDED_FILE).write_text(text, errors="surrogateescape")
    nodes = [e.node for e in read_exclusions(tmp_path)]
    assert nodes == (["n3"] if '"n3"}' in text else [])
    err = capsys.readouterr().err
    assert f"warning: {tmp_path / EXCLUDED_FILE}: " in err and said in err and "\x00" not in err


def test_add_refuses_what_is_not_a_node_name(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not a node name"):
        add_exclusions(tmp_path, ["n[1-2]"], "node_failure", "1", "x")
    assert not (tmp_path / EXCLUDED_FILE).exists()
