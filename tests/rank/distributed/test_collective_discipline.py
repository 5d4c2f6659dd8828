"""No torch.distributed collective outside the helpers that put its tensor on the group's device.

Why: a CPU tensor all-reduced over an NCCL group fails on the GPU cluster only ("No backend type associated
with device type cpu"), so CI on CPUs can never catch it at run time. This reads the source instead: every
collective goes through ``hpc_train.rank.distributed.collectives``, except where the tensors are by construction
on the right device.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[3] / "hpc_train"
COLLECTIVES = {"all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "all_to_all",
               "all_to_all_single", "barrier", "broadcast", "broadcast_object_list", "gather", "gather_object",
               "irecv", "isend", "recv", "reduce", "reduce_scatter", "reduce_scatter_tensor", "scatter",
               "scatter_object_list", "send", "monitored_barrier", "all_reduce_coalesced"}
# file: why its tensors are on the group's device without the helper
EXEMPT = {
    "rank/distributed/collectives.py": "the helpers themselves",
    "rank/distributed/tensor_parallel.py": "the model's own activations and weights, on the model's device",
    "bench/collectives.py": "the benchmark allocates every buffer on the device it measures",
}


def _dist_names(tree: ast.Module) -> tuple[set[str], set[str]]:
    """Names bound to torch.distributed (``import torch.distributed as dist``) and collectives imported bare."""
    modules, bare = {"torch.distributed"}, set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules |= {a.asname or a.name for a in node.names if a.name == "torch.distributed"}
        elif isinstance(node, ast.ImportFrom) and node.module == "torch.distributed":
            bare |= {a.asname or a.name for a in node.names if a.name in COLLECTIVES}
        elif isinstance(node, ast.ImportFrom) and node.module == "torch":
            modules |= {a.asname or a.name for a in node.names if a.name == "distributed"}
    return modules, bare


def _called(func: ast.expr) -> tuple[str, str] | None:
    if isinstance(func, ast.Name):
        return "", func.id
    if isinstance(func, ast.Attribute):
        owner = ast.unparse(func.value)
        return owner, func.attr
    return None


def collective_calls(path: Path, root: Path = PACKAGE) -> list[str]:
    """``file:line name`` of each torch.distributed collective called (or passed as a callable) in ``path``."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    modules, bare = _dist_names(tree)
    found = []
    for node in ast.walk(tree):
        target = node.func if isinstance(node, ast.Call) else node if isinstance(node, ast.Attribute) else None
        named = _called(target) if target is not None else None
        if named is None:
            continue
        owner, name = named
        if (owner in modules and name in COLLECTIVES) or (not owner and name in bare):
            found.append(f"{path.relative_to(root)}:{node.lineno} {name}")
    return sorted(set(found))


def test_every_collective_goes_through_the_device_helpers() -> None:
    stray = [call for path in sorted(PACKAGE.rglob("*.py")) if str(path.relative_to(PACKAGE)) not in EXEMPT
             for call in collective_calls(path)]
    assert not stray, ("collectives outside hpc_train.rank.distributed.collectives (their tensor may be on the wrong "
                       "device for NCCL):\n" + "\n".join(stray))


def test_the_scan_sees_every_spelling(tmp_path: Path) -> None:
    sample = tmp_path / "sample.py"
    sample.write_text("import torch.distributed as dist\nimport torch\nfrom torch.distributed import all_reduce as ar\n"
                      "dist.all_reduce(x)\ntorch.distributed.broadcast(x, 0)\nar(x)\nbarrier_fn = dist.barrier\n"
                      "dist.get_rank()\n", encoding="utf-8")
    assert collective_calls(sample, tmp_path) == ["sample.py:4 all_reduce", "sample.py:5 broadcast", "sample.py:6 ar",
                                                  "sample.py:7 barrier"]


def test_every_exemption_is_still_a_file() -> None:
    assert all((PACKAGE / name).is_file() for name in EXEMPT)
