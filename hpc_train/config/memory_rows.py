"""``validate --memory``'s rows: a :class:`~hpc_train.config.memory.MemoryPlan` in words, with the engine's quirks
that apply, what to try when it does not fit, and a verdict. Pure Python, like the plan it describes."""

from __future__ import annotations

from hpc_train.config.job import MODEL_PRESETS
from hpc_train.config.memory import GIB, PRECISION_BYTES, MemoryPlan

__all__ = ["memory_rows"]


def _size(nbytes: int) -> str:
    """``1.23 GiB``, ``45.6 MiB`` or ``7.8 KiB``."""
    for unit, scale in (("GiB", GIB), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{nbytes} B"


def _advice(plan: MemoryPlan) -> list[str]:
    """What would shrink the biggest figures, in the order worth trying."""
    fsdp2 = plan.engine == "fsdp2"  # zero_stage 3: no ZeRO advice; its one offload key
    advice = ["fsdp.reshard_after_forward = true"] if fsdp2 and not plan.reshard_after_forward else []
    if plan.zero_stage < 3 and plan.data > 1:
        advice.append("zero.stage = 3")
    heads = MODEL_PRESETS.get(plan.preset, {}).get("heads", 1)
    if heads % (2 * plan.tensor) == 0:
        advice.append(f"more tensor parallel (parallel.tensor = {2 * plan.tensor})")
    if plan.zero_stage and not plan.offload_optimizer:
        advice.append("fsdp.offload = true" if fsdp2 else "zero.offload_optimizer = true")
    if plan.zero_stage == 3 and not plan.offload_params and not fsdp2:
        advice.append("zero.offload_params = true")
    if plan.activations >= max(plan.parameters, plan.gradients, plan.optimizer_state):
        advice.append("a smaller train.micro_batch")
    if plan.data == 1 and plan.zero_stage:
        advice.append(f"more data-parallel ranks ({'FSDP2' if fsdp2 else 'ZeRO'} shards over them)")
    return advice or ["a smaller model"]


def _verdict(plan: MemoryPlan) -> str:
    if plan.fits is None:
        return (f"{_size(plan.total)} per rank needed; the site gives no GPU memory size (node.gpu_mem_gb), "
                "so nothing is checked")
    gpu = f"{plan.gpu_bytes / GIB:g} GiB"
    if plan.fits:
        spare = 1 - plan.total / plan.gpu_bytes
        text = f"fits in {gpu} with {spare:.0%} to spare"
        if spare < 0.10:
            text += " (tight: the CUDA context and allocator fragmentation are not counted)"
        return text
    advice = _advice(plan)
    tries = advice[0] if len(advice) == 1 else ", ".join(advice[:-1]) + ", or " + advice[-1]
    return f"does not fit: {plan.total / GIB:.1f} GiB > {gpu}; try {tries}"


def memory_rows(plan: MemoryPlan) -> list[tuple[str, str]]:
    """Human rows ``(label, text)`` for ``validate --memory``: the figures, the engine's quirks that apply, and a
    verdict row last."""
    width = PRECISION_BYTES[plan.precision]
    sharded = plan.zero_stage > 0 and plan.data > 1
    if plan.zero_stage == 3:
        params = "ZeRO-3 partition + small parameters whole" + (", partitions in CPU memory" if plan.offload_params
                                                                 else "")
    else:
        params = "full copy on every data-parallel rank"
    if plan.gradients == 0:
        grads = "none on the GPU: they go to the offloaded optimizer"
    elif plan.gradients >= width * plan.params_per_rank:
        grads = "full"
    else:
        grads = "this rank's partition"
    state = "fp32 master + Adam m, v" if plan.zero_stage or plan.precision != "fp32" else "Adam m, v"
    state += f", 1/{plan.data} per rank" if sharded else ", whole on every rank"
    if plan.offload_optimizer:
        state += ", in CPU memory"
    tokens = f"micro batch {plan.micro_batch} x {plan.seq_len} tokens"
    if plan.pipeline > 1:
        tokens += f", up to {min(plan.pipeline, plan.grad_accum)} micro-batches in flight"
    engine = "FSDP2" if plan.engine == "fsdp2" else f"ZeRO-{plan.zero_stage}"
    rows = [
        ("layout", f"{plan.preset}, tensor {plan.tensor} x pipeline {plan.pipeline} x data {plan.data}, "
                   f"{engine}, {plan.precision}; {plan.params_per_rank:,} parameters per rank"
                   + (f" (pipeline stage {plan.stage}, the largest)" if plan.pipeline > 1 else "")),
        ("parameters", f"{_size(plan.parameters)} per rank ({params})"),
        ("gradients", f"{_size(plan.gradients)} per rank ({grads})"),
        ("optimizer state", f"{_size(plan.optimizer_state)} per rank ({state})"),
        ("activations", f"{_size(plan.activations)} per rank (rough, {tokens}, no recomputation)"
                        if plan.preset in MODEL_PRESETS else "not counted for your own model"),
        ("DeepSpeed buffers", f"{_size(plan.buffers)} per rank at peak (gradient reduction "
                              f"{_size(plan.reduce_buffers)}, optimizer step {_size(plan.step_buffers)})"),
        ("total", f"{_size(plan.total)} per rank on the GPU"),
    ]
    if plan.cpu:
        rows.append(("CPU memory", f"{_size(plan.cpu)} per rank (offload)"))
    if plan.engine == "fsdp2":
        rows = _fsdp2_rows(plan, rows)
    rows += [("note", note) for note in plan.notes]
    rows.append(("verdict", _verdict(plan)))
    return rows


def _fsdp2_rows(plan: MemoryPlan, rows: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """``memory_rows``' figure rows in FSDP2's words: what its parameters, gradients, optimizer state and buffers
    are ."""
    where = ", in CPU memory" if plan.offload_params else ""
    compute = "bf16" if plan.precision == "bf16" else "fp32"
    kept = "one block" if plan.reshard_after_forward else "every block"
    gathered = "your model, one group," if ":" in plan.preset else f"the root and {kept}"

    def held(nbytes: int) -> str:
        return "none on the GPU" if plan.offload_params else f"{_size(nbytes)} per rank"

    own = {
        "parameters": ("parameters", f"{held(plan.parameters)} (fp32 shards: 1/{plan.data} of each tensor's dim 0, "
                                     f"padded{where})"),
        "gradients": ("gradients", f"{held(plan.gradients)} (fp32 shards, reduce-scattered{where})"),
        "optimizer state": ("optimizer state", f"{held(plan.optimizer_state)} (Adam m, v on the fp32 shards, no "
                                               f"master copy{where})"),
        "DeepSpeed buffers": ("FSDP2 buffers", f"{_size(plan.buffers)} per rank at peak (forward and backward "
                                               f"{_size(plan.reduce_buffers)}: the {compute} parameters of "
                                               f"{gathered} gathered, {_size(plan.gathered)}, their all-gather "
                                               "buffers, unsharded gradients and fp32 reduce-scatter inputs; "
                                               f"optimizer step {_size(plan.step_buffers)})"),
    }
    return [own.get(label, (label, text)) for label, text in rows]
