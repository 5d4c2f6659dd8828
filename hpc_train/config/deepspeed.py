"""The DeepSpeed JSON for a job: what the typed config models, plus the user's ``[deepspeed]`` table for the
keys it does not. Pure Python, so the login node checks for conflicts before anything is submitted."""

from __future__ import annotations

import copy
from typing import Any

from hpc_train.config.job import JobConfig
from hpc_train.config.secrets import REDACTED

__all__ = ["deepspeed_config", "merge_user_table", "without_redacted"]


def deepspeed_config(config: JobConfig, data_parallel: int) -> dict[str, Any]:
    """The DeepSpeed JSON for a resolved job config (``plan.config``)."""
    train, zero = config.train, config.zero
    stage = zero.stage
    ds: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": train.micro_batch,
        "gradient_accumulation_steps": train.grad_accum,
        "train_batch_size": train.micro_batch * train.grad_accum * data_parallel,
        "gradient_clipping": train.grad_clip,
        "steps_per_print": 10**9,
        "zero_optimization": {"stage": stage},
        "bf16": {"enabled": train.precision == "bf16"},
        "fp16": {"enabled": train.precision == "fp16"},
    }
    if stage:
        ds["zero_optimization"].update(overlap_comm=zero.overlap_comm, reduce_bucket_size=zero.bucket_size,
                                       contiguous_gradients=True)
    if stage in (1, 2):
        ds["zero_optimization"]["allgather_bucket_size"] = zero.bucket_size
    if zero.offload_optimizer:
        ds["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    if zero.offload_params:
        ds["zero_optimization"]["offload_param"] = {"device": "cpu"}
    if train.optimizer != "torch_adamw":
        ds["optimizer"] = {"type": "AdamW" if train.optimizer == "cpu_adam" else "Adam",
                           "params": {"lr": train.lr, "betas": [train.beta1, train.beta2],
                                      "eps": train.eps, "weight_decay": train.weight_decay,
                                      **({"adam_w_mode": True} if train.optimizer == "fused_adam" else {})}}
    return merge_user_table(ds, without_redacted(config.deepspeed))


def without_redacted(value: Any) -> Any:
    """``value`` less every credential the plan holds as ``"<redacted>"`` (:mod:`hpc_train.config.screen`):
    DeepSpeed's loggers then read it from the environment (``job.forward_env``) instead of a placeholder."""
    if isinstance(value, dict):
        return {key: without_redacted(item) for key, item in value.items() if item != REDACTED}
    if isinstance(value, list):
        return [without_redacted(item) for item in value if item != REDACTED]
    return value


def merge_user_table(modelled: dict[str, Any], user: dict[str, Any], prefix: str = "deepspeed") -> dict[str, Any]:
    """``modelled`` with ``user`` merged in; a key both set (to different values) is a ValueError naming the
    typed key to use instead."""
    merged = copy.deepcopy(modelled)
    for key, value in user.items():
        where = f"{prefix}.{key}"
        if key not in merged:
            merged[key] = copy.deepcopy(value)
        elif isinstance(merged[key], dict) and isinstance(value, dict):
            merged[key] = merge_user_table(merged[key], value, where)
        elif merged[key] != value:
            raise ValueError(f"{where} = {value!r} conflicts with {merged[key]!r} from the typed config; set it "
                             "through its own key (zero.*, train.*) instead of the [deepspeed] table")
    return merged
