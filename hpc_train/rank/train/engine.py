"""The DeepSpeed engine built from the typed config (:mod:`hpc_train.config.deepspeed`), with AdamW and the
learning-rate schedule. The DeepSpeed config that results is written into the run folder, so what ran can be
read and rerun by hand."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch

from hpc_train.config.deepspeed import deepspeed_config, unfilled_auto
from hpc_train.config.job import MODEL_PRESETS, JobConfig, TrainSection
from hpc_train.run.files import atomic_write
from hpc_train.run.paths import DEEPSPEED_CONFIG_FILE

__all__ = ["build_engine", "deepspeed_config", "lr_at", "weight_decay_groups"]


def lr_at(step: int, train: TrainSection) -> float:
    """Linear warm-up to ``lr``, then cosine or linear decay to ``min_lr`` at the last step (or constant)."""
    peak, floor, warmup, total = train.lr, train.min_lr, train.warmup_steps, train.steps
    if warmup and step < warmup:
        return peak * (step + 1) / warmup
    if train.decay == "constant" or total <= warmup:
        return peak
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    if train.decay == "linear":
        return peak - (peak - floor) * progress
    return floor + 0.5 * (peak - floor) * (1 + math.cos(math.pi * progress))


def hidden_size(model: torch.nn.Module, config: JobConfig) -> int | None:
    """The model's hidden size as the Hugging Face integration reads it (``config.hidden_size``, the largest of
    ``hidden_sizes``, the same of a ``text_config``), else the built-in GPT's; None when neither says (a
    ``ds_config.json`` that asks ``"auto"`` of a key that needs it is then refused, naming the keys)."""
    found = getattr(model, "config", None)
    for candidate in (found, getattr(found, "text_config", None)):
        if isinstance(getattr(candidate, "hidden_size", None), int):
            return int(candidate.hidden_size)
        sizes = getattr(candidate, "hidden_sizes", None)
        if isinstance(sizes, list | tuple) and sizes:
            return int(max(sizes))
    preset = MODEL_PRESETS.get(config.train.model)
    return int(preset["hidden"]) if preset is not None else None


def weight_decay_groups(model: torch.nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Weight decay on matrices only; biases, norms and position embeddings keep theirs at zero."""
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    rest = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}]


def build_engine(model: torch.nn.Module, config: JobConfig, data_parallel: int, mpu: Any,
                 run_dir: Path | None, local_rank: int | None = None) -> Any:
    """``deepspeed.initialize`` with our optimizer (by default torch's AdamW: nothing is compiled), schedule and
    groups; rank 0 writes ``deepspeed_config.json`` into the run folder. DeepSpeed's communication layer
    starts first (:mod:`hpc_train.rank.train.dscomm`): its ops built by local rank 0 of each node, no shm buffers."""
    import deepspeed
    import torch.distributed as dist

    from hpc_train.rank.train.dscomm import init_deepspeed_comm
    from hpc_train.rank.train.jit_ops import OPTIMIZER_OPS

    train = config.train
    init_deepspeed_comm(local_rank, OPTIMIZER_OPS[train.optimizer])

    ds = deepspeed_config(config, data_parallel, hidden_size(model, config))
    left = unfilled_auto(ds)
    if left:
        raise ValueError(f"the DeepSpeed config asks \"auto\" of {', '.join(left)}, which follow the model's hidden "
                         "size, and the model's config says none (no hidden_size or hidden_sizes); give numbers")
    optimizer: Any = None
    if train.optimizer == "torch_adamw":
        optimizer = torch.optim.AdamW(weight_decay_groups(model, train.weight_decay), lr=train.lr,
                                      betas=(train.beta1, train.beta2), eps=train.eps)
        ds["zero_allow_untested_optimizer"] = True
    if run_dir is not None and dist.get_rank() == 0:
        atomic_write(run_dir / DEEPSPEED_CONFIG_FILE, json.dumps(ds, indent=2, sort_keys=True) + "\n")
    def schedule(basic_optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
        return torch.optim.lr_scheduler.LambdaLR(basic_optimizer, lambda step: lr_at(step, train) / train.lr)

    # A ds_config.json's own scheduler is DeepSpeed's to build (as it would without hpc_train); else ours
    engine, *_ = deepspeed.initialize(
        model=model, optimizer=optimizer, config=ds, mpu=mpu, lr_scheduler=None if "scheduler" in ds else schedule,
        model_parameters=None if optimizer is not None else weight_decay_groups(model, train.weight_decay))
    _check_groups(engine, data_parallel, mpu)
    return engine


def _check_groups(engine: Any, data_parallel: int, mpu: Any) -> None:
    """DeepSpeed must reduce gradients over our data-parallel group (its size and its ranks): with other groups
    training would go on, averaging over the wrong ranks, and no loss curve would say why."""
    import torch.distributed as dist

    ranks = dist.get_process_group_ranks(engine.data_parallel_group) if dist.is_initialized() else [0]
    expected = mpu.get_data_parallel_group_ranks() if mpu is not None else None
    if engine.dp_world_size != data_parallel or (expected is not None and sorted(ranks) != sorted(expected)):
        raise RuntimeError(f"DeepSpeed's data-parallel group is ranks {sorted(ranks)} ({engine.dp_world_size}), but "
                           f"the layout's data axis is {data_parallel} ranks"
                           + (f" {sorted(expected)}" if expected is not None else "")
                           + ": the engine did not take hpc_train's groups (mpu)")
