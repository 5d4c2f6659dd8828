"""Tensor-parallel layers on real gloo process groups against an unsharded single-process reference.

One launch of 4 processes per TP size runs every check and reports tensors; the tests here compare them with
plain-torch (TP = 1) results computed in this process: outputs, losses, input gradients and each weight shard's
gradient against the matching slice of the reference gradient, all in float32, within 1e-6. TP = 2 runs as
two TP groups of 2 (explicit ProcessGroups, ranks 2-3 have group ranks 0-1); TP = 4 uses the default group.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F  # noqa: N812

from hpc_train.rank.distributed.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    partition_size,
    tp_rank,
    tp_world_size,
    vocab_parallel_cross_entropy,
)
from tests.rank.distributed.multiproc import WorkersFailedError, run_workers

HIDDEN, FFN, VOCAB, BATCH, SEQ = 8, 16, 16, 2, 6
TOLERANCE = 1e-6
LARGE_OFFSET = 1e4  # exp(1e4) overflows float32: only a max-shifted cross entropy survives it
BAD_OUT, BAD_IN, BAD_VOCAB = 9, 9, 51  # divisible by neither 2 nor 4

Tensors = dict[str, torch.Tensor]


def make_case() -> Tensors:
    """Inputs, full weights and upstream gradients, identical in every process (seeded CPU generator)."""
    g = torch.Generator().manual_seed(20261129)

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * scale

    return {
        "x": randn(BATCH, SEQ, HIDDEN), "dy": randn(BATCH, SEQ, HIDDEN, scale=0.2),
        "w1": randn(FFN, HIDDEN, scale=0.3), "b1": randn(FFN, scale=0.1),
        "w2": randn(HIDDEN, FFN, scale=0.3), "b2": randn(HIDDEN, scale=0.1),
        "ids": torch.randint(0, VOCAB, (BATCH, SEQ), generator=g), "emb": randn(VOCAB, HIDDEN),
        "demb": randn(BATCH, SEQ, HIDDEN, scale=0.5),
        "logits": randn(BATCH, SEQ, VOCAB, scale=0.5), "target": torch.randint(0, VOCAB, (BATCH, SEQ), generator=g),
        "dloss": randn(BATCH, SEQ, scale=0.5), "head": randn(VOCAB, HIDDEN, scale=0.15),
    }


# ---------------------------------------------------------------------------------------------------------------
# TP = 1 reference: plain torch, no tensor-parallel code
# ---------------------------------------------------------------------------------------------------------------

def _leaf(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.clone().requires_grad_()


def reference_mlp(case: Tensors) -> Tensors:
    x, w1, b1, w2, b2 = (_leaf(case[k]) for k in ("x", "w1", "b1", "w2", "b2"))
    h = F.linear(x, w1, b1)
    y = F.linear(F.gelu(h), w2, b2)
    (y * case["dy"]).sum().backward()
    return {"h": h.detach(), "y": y.detach(), "grad_x": x.grad, "grad_w1": w1.grad, "grad_b1": b1.grad,
            "grad_w2": w2.grad, "grad_b2": b2.grad}


def reference_embedding(case: Tensors) -> Tensors:
    emb = _leaf(case["emb"])
    out = F.embedding(case["ids"], emb)
    (out * case["demb"]).sum().backward()
    return {"out": out.detach(), "grad_emb": emb.grad}


def reference_cross_entropy(case: Tensors, offset: float = 0.0) -> Tensors:
    logits = _leaf(case["logits"] + offset)
    loss = F.cross_entropy(logits.view(-1, VOCAB), case["target"].view(-1), reduction="none").view(BATCH, SEQ)
    (loss * case["dloss"]).sum().backward()
    return {"loss": loss.detach(), "grad_logits": logits.grad}


def reference_model(case: Tensors) -> Tensors:
    emb, w1, b1, w2, b2, head = (_leaf(case[k]) for k in ("emb", "w1", "b1", "w2", "b2", "head"))
    h = F.embedding(case["ids"], emb)
    h = h + F.linear(F.gelu(F.linear(h, w1, b1)), w2, b2)
    logits = F.linear(h, head)
    loss = F.cross_entropy(logits.view(-1, VOCAB), case["target"].view(-1), reduction="none").view(BATCH, SEQ)
    loss.mean().backward()
    return {"loss": loss.detach(), "grad_emb": emb.grad, "grad_w1": w1.grad, "grad_b1": b1.grad,
            "grad_w2": w2.grad, "grad_b2": b2.grad, "grad_head": head.grad}


# ---------------------------------------------------------------------------------------------------------------
# The same computations with the tensor-parallel layers (run in the workers; at TP = 1 also in this process)
# ---------------------------------------------------------------------------------------------------------------

def tp_mlp(case: Tensors, group: Any, gathered: bool) -> Tensors:
    """Column then row parallel; ``gathered`` gathers the column output and lets the row layer split it."""
    col = ColumnParallelLinear(HIDDEN, FFN, group, gather_output=gathered)
    row = RowParallelLinear(FFN, HIDDEN, group, input_is_parallel=not gathered)
    col.copy_from_full(case["w1"], case["b1"])
    row.copy_from_full(case["w2"], case["b2"])
    x = _leaf(case["x"])
    h = col(x)
    y = row(F.gelu(h))
    (y * case["dy"]).sum().backward()
    return {"h": h.detach(), "y": y.detach(), "grad_x": x.grad, "grad_w1": col.weight.grad,
            "grad_b1": col.bias.grad, "grad_w2": row.weight.grad, "grad_b2": row.bias.grad}


def tp_embedding(case: Tensors, group: Any) -> Tensors:
    emb = VocabParallelEmbedding(VOCAB, HIDDEN, group)
    emb.copy_from_full(case["emb"])
    out = emb(case["ids"])
    (out * case["demb"]).sum().backward()
    return {"out": out.detach(), "grad_emb": emb.weight.grad}


def tp_cross_entropy(case: Tensors, group: Any, offset: float = 0.0) -> Tensors:
    part = VOCAB // tp_world_size(group)
    start = tp_rank(group) * part
    logits = _leaf((case["logits"] + offset)[..., start:start + part])
    loss = vocab_parallel_cross_entropy(logits, case["target"], group)
    (loss * case["dloss"]).sum().backward()
    return {"loss": loss.detach(), "grad_logits": logits.grad}


def tp_model(case: Tensors, group: Any) -> Tensors:
    emb = VocabParallelEmbedding(VOCAB, HIDDEN, group)
    col = ColumnParallelLinear(HIDDEN, FFN, group)
    row = RowParallelLinear(FFN, HIDDEN, group)
    head = ColumnParallelLinear(HIDDEN, VOCAB, group, bias=False)
    emb.copy_from_full(case["emb"])
    col.copy_from_full(case["w1"], case["b1"])
    row.copy_from_full(case["w2"], case["b2"])
    head.copy_from_full(case["head"])
    h = emb(case["ids"])
    h = h + row(F.gelu(col(h)))
    loss = vocab_parallel_cross_entropy(head(h), case["target"], group)
    loss.mean().backward()
    return {"loss": loss.detach(), "grad_emb": emb.weight.grad, "grad_w1": col.weight.grad,
            "grad_b1": col.bias.grad, "grad_w2": row.weight.grad, "grad_b2": row.bias.grad,
            "grad_head": head.weight.grad}


def seeded_layers(group: Any) -> dict[str, torch.nn.Module]:
    """Layers initialised from seeds and from one shared generator, in a fixed order."""
    shared = torch.Generator().manual_seed(9)
    return {
        "col": ColumnParallelLinear(HIDDEN, FFN, group, seed=7),
        "row": RowParallelLinear(FFN, HIDDEN, group, seed=8,
                                 init_method=lambda w, g: torch.nn.init.xavier_uniform_(w, generator=g)),
        "emb": VocabParallelEmbedding(VOCAB, HIDDEN, group, seed=shared),
        "head": ColumnParallelLinear(HIDDEN, VOCAB, group, bias=False, seed=shared),
    }


def _prefixed(prefix: str, tensors: Tensors) -> Tensors:
    return {f"{prefix}/{name}": value for name, value in tensors.items()}


def tp_worker(rank: int, world_size: int, tp: int) -> dict[str, Any]:
    """Every check at one TP size; ``world_size / tp`` independent TP groups compute the same thing."""
    import torch.distributed as dist

    if tp == world_size:
        group = None  # the default group
    else:
        groups = [dist.new_group(list(range(first, first + tp))) for first in range(0, world_size, tp)]
        group = groups[rank // tp]
    case = make_case()
    out: Tensors = {}
    out.update(_prefixed("mlp", tp_mlp(case, group, gathered=False)))
    out.update(_prefixed("mlp_gathered", tp_mlp(case, group, gathered=True)))
    out.update(_prefixed("embedding", tp_embedding(case, group)))
    out.update(_prefixed("cross_entropy", tp_cross_entropy(case, group)))
    out.update(_prefixed("cross_entropy_large", tp_cross_entropy(case, group, offset=LARGE_OFFSET)))
    out.update(_prefixed("model", tp_model(case, group)))
    for name, layer in seeded_layers(group).items():
        out[f"init/{name}/shard"] = layer.weight.detach()
        full = layer.gather_full()
        out[f"init/{name}/gathered"] = full if isinstance(full, torch.Tensor) else full[0]
    errors: dict[str, str] = {}
    for name, build in {"column": lambda: ColumnParallelLinear(HIDDEN, BAD_OUT, group),
                        "row": lambda: RowParallelLinear(BAD_IN, HIDDEN, group),
                        "embedding": lambda: VocabParallelEmbedding(BAD_VOCAB, HIDDEN, group)}.items():
        try:
            build()
            errors[name] = "no error"
        except ValueError as error:
            errors[name] = str(error)
    return {"rank": rank, "tp": tp_world_size(group), "tp_rank": tp_rank(group), "tensors": out, "errors": errors}


# ---------------------------------------------------------------------------------------------------------------
# Comparisons
# ---------------------------------------------------------------------------------------------------------------

def _shard(full: torch.Tensor, dim: int, tp: int, rank: int) -> torch.Tensor:
    return full.chunk(tp, dim=dim)[rank]


# How each reported tensor relates to the reference: replicated (None) or the rank's shard along a dimension.
SHARDING = {
    "mlp": {"h": -1, "y": None, "grad_x": None, "grad_w1": 0, "grad_b1": 0, "grad_w2": 1, "grad_b2": None},
    "mlp_gathered": {"h": None, "y": None, "grad_x": None, "grad_w1": 0, "grad_b1": 0, "grad_w2": 1,
                     "grad_b2": None},
    "embedding": {"out": None, "grad_emb": 0},
    "cross_entropy": {"loss": None, "grad_logits": -1},
    "cross_entropy_large": {"loss": None, "grad_logits": -1},
    "model": {"loss": None, "grad_emb": 0, "grad_w1": 0, "grad_b1": 0, "grad_w2": 1, "grad_b2": None,
              "grad_head": 0},
}


def max_differences(check: str, reference: Tensors, reports: list[dict[str, Any]]) -> dict[str, float]:
    """Largest |TP - reference| per tensor over all ranks (a shape mismatch is a failure, not a number)."""
    worst: dict[str, float] = {}
    for report in reports:
        tp, rank = report["tp"], report["tp_rank"]
        for name, dim in SHARDING[check].items():
            expected = reference[name] if dim is None else _shard(reference[name], dim, tp, rank)
            actual = report["tensors"][f"{check}/{name}"]
            assert actual.dtype == torch.float32, f"{check}/{name} is {actual.dtype}"
            assert actual.shape == expected.shape, f"{check}/{name}: {tuple(actual.shape)} vs {tuple(expected.shape)}"
            difference = (actual - expected).abs().max().item()
            worst[name] = max(worst.get(name, 0.0), difference)
    return worst


def assert_close(check: str, tp: int, worst: dict[str, float]) -> None:
    print(f"\nTP={tp} {check}: " + ", ".join(f"{name} {value:.1e}" for name, value in worst.items()))
    too_far = {name: value for name, value in worst.items() if not value <= TOLERANCE}
    assert not too_far, f"TP={tp} {check}: differences above {TOLERANCE}: {too_far}"


@pytest.fixture(scope="module", params=[2, 4], ids=["tp2x2groups", "tp4"])
def tp_reports(request: pytest.FixtureRequest) -> Iterator[list[dict[str, Any]]]:
    """One launch of 4 gloo processes per TP size; every rank's report."""
    tp = request.param
    reports = run_workers(functools.partial(tp_worker, tp=tp), world_size=4, timeout_s=90.0)
    assert [r["rank"] for r in reports] == [0, 1, 2, 3]
    assert [(r["tp"], r["tp_rank"]) for r in reports] == [(tp, rank % tp) for rank in range(4)]
    yield reports


@pytest.fixture(scope="module")
def case() -> Tensors:
    return make_case()


@pytest.mark.slow
@pytest.mark.parametrize("check", ["mlp", "mlp_gathered"])
def test_mlp_block_matches_unsharded(tp_reports: list[dict[str, Any]], case: Tensors, check: str) -> None:
    assert_close(check, tp_reports[0]["tp"], max_differences(check, reference_mlp(case), tp_reports))


@pytest.mark.slow
def test_embedding_matches_unsharded(tp_reports: list[dict[str, Any]], case: Tensors) -> None:
    check = "embedding"
    assert_close(check, tp_reports[0]["tp"], max_differences(check, reference_embedding(case), tp_reports))


@pytest.mark.slow
@pytest.mark.parametrize(("check", "offset"), [("cross_entropy", 0.0), ("cross_entropy_large", LARGE_OFFSET)])
def test_cross_entropy_matches_unsharded(tp_reports: list[dict[str, Any]], case: Tensors, check: str,
                                         offset: float) -> None:
    reference = reference_cross_entropy(case, offset)
    assert torch.isfinite(reference["loss"]).all()
    assert_close(check, tp_reports[0]["tp"], max_differences(check, reference, tp_reports))


@pytest.mark.slow
def test_embedding_mlp_head_cross_entropy_matches_unsharded(tp_reports: list[dict[str, Any]], case: Tensors) -> None:
    check = "model"
    assert_close(check, tp_reports[0]["tp"], max_differences(check, reference_model(case), tp_reports))


@pytest.mark.slow
def test_initialisation_equals_tp1(tp_reports: list[dict[str, Any]]) -> None:
    """Seeded (and shared-generator) init gives each rank exactly its slice of the TP = 1 weights."""
    unsharded = seeded_layers(None)  # no process group in this process: TP = 1
    for report in tp_reports:
        tp, rank = report["tp"], report["tp_rank"]
        for name, layer in unsharded.items():
            full = layer.weight.detach()
            dim = 1 if name == "row" else 0
            assert torch.equal(report["tensors"][f"init/{name}/shard"], _shard(full, dim, tp, rank)), name
            assert torch.equal(report["tensors"][f"init/{name}/gathered"], full), name


@pytest.mark.slow
def test_divisibility_errors_on_real_groups_name_the_sizes(tp_reports: list[dict[str, Any]]) -> None:
    for report in tp_reports:
        tp, errors = report["tp"], report["errors"]
        assert f"out_features={BAD_OUT}" in errors["column"] and f"size {tp};" in errors["column"]
        assert f"in_features={BAD_IN}" in errors["row"] and f"size {tp};" in errors["row"]
        assert f"num_embeddings={BAD_VOCAB}" in errors["embedding"] and f"size {tp};" in errors["embedding"]
        assert "pad the vocabulary" in errors["embedding"]
        padded = -(-BAD_VOCAB // tp) * tp
        assert f"multiple of {tp} (e.g. {padded})" in errors["embedding"]


# ---------------------------------------------------------------------------------------------------------------
# In this process only (fast)
# ---------------------------------------------------------------------------------------------------------------

def test_tp1_layers_in_one_process_match_plain_torch(case: Tensors) -> None:
    """Without a process group, group=None means TP = 1: the same layers are the unsharded model."""
    for check, ours, reference in [
        ("mlp", tp_mlp(case, None, gathered=False), reference_mlp(case)),
        ("mlp_gathered", tp_mlp(case, None, gathered=True), reference_mlp(case)),
        ("embedding", tp_embedding(case, None), reference_embedding(case)),
        ("cross_entropy", tp_cross_entropy(case, None), reference_cross_entropy(case)),
        ("cross_entropy_large", tp_cross_entropy(case, None, LARGE_OFFSET),
         reference_cross_entropy(case, LARGE_OFFSET)),
        ("model", tp_model(case, None), reference_model(case)),
    ]:
        report = {"tp": 1, "tp_rank": 0, "tensors": _prefixed(check, ours)}
        assert_close(check, 1, max_differences(check, reference, [report]))


def test_partition_size_error_names_sizes_and_fix() -> None:
    assert partition_size(50264, 8) == 6283
    with pytest.raises(ValueError, match=r"VocabParallelEmbedding: num_embeddings=50257 is not divisible by the "
                       r"tensor-parallel size 8; pad the vocabulary .* multiple of 8 \(e\.g\. 50264\)"):
        partition_size(50257, 8, name="num_embeddings", owner="VocabParallelEmbedding", fix="pad the vocabulary to")
    with pytest.raises(ValueError, match=r"out_features=10 is not divisible by the tensor-parallel size 4; make "
                                         r"out_features a multiple of 4 \(e\.g\. 12\) or use a tensor-parallel size"):
        partition_size(10, 4, name="out_features")
    with pytest.raises(ValueError, match="at least 1"):
        partition_size(8, 0)


def test_copy_from_full_rejects_a_wrong_shape() -> None:
    layer = ColumnParallelLinear(HIDDEN, FFN, None)
    with pytest.raises(ValueError, match=r"shape \(8, 16\), expected \(16, 8\)"):
        layer.copy_from_full(torch.zeros(HIDDEN, FFN))


def test_cross_entropy_rejects_mismatched_target() -> None:
    with pytest.raises(ValueError, match="does not match"):
        vocab_parallel_cross_entropy(torch.zeros(4, VOCAB), torch.zeros(5, dtype=torch.long), None)


# ---------------------------------------------------------------------------------------------------------------
# The launch helper itself: judged by reports, not exit codes
# ---------------------------------------------------------------------------------------------------------------

def _abort_now(*_args: Any, **_kwargs: Any) -> None:
    import os
    import resource

    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # no core file
    os.abort()


def all_reduce_then_abort_at_teardown(rank: int, world_size: int) -> dict[str, Any]:
    """Rank 0 aborts in destroy_process_group after its report, like the platform's exit-time abort."""
    import torch.distributed as dist

    total = torch.full((1,), float(rank))
    dist.all_reduce(total)
    if rank == 0:
        dist.destroy_process_group = _abort_now
    return {"sum": total}


def fail_on_rank_1(rank: int, world_size: int) -> dict[str, Any]:
    """Rank 1 raises; rank 0 is left waiting in a collective that never completes."""
    import torch.distributed as dist

    if rank == 1:
        raise RuntimeError("deliberate failure on rank 1")
    dist.all_reduce(torch.zeros(1))
    return {}


@pytest.mark.slow
def test_an_abort_after_the_report_does_not_fail_the_run() -> None:
    reports = run_workers(all_reduce_then_abort_at_teardown, world_size=2, timeout_s=60.0)
    assert [report["sum"].item() for report in reports] == [1.0, 1.0]


@pytest.mark.slow
def test_a_rank_error_is_reported_with_its_traceback_without_waiting_for_the_timeout() -> None:
    import time

    started = time.monotonic()
    with pytest.raises(WorkersFailedError, match=r"(?s)rank 1 ---.*deliberate failure on rank 1"):
        run_workers(fail_on_rank_1, world_size=2, timeout_s=60.0)
    assert time.monotonic() - started < 30.0
