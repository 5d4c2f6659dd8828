"""The DeepSpeed JSON for a job: what the typed config models, plus the user's ``[deepspeed]`` table for the
keys it does not. Pure Python, so the login node checks for conflicts before anything is submitted."""

from __future__ import annotations

import copy
from typing import Any

from hpc_train.config.job import JobConfig
from hpc_train.config.secrets import REDACTED
from hpc_train.errors import ConfigError

__all__ = ["AUTO_SCHEDULE_KEYS", "HIDDEN_SIZE_KEYS", "SCHEDULER_PARAMS", "check_scheduler", "deepspeed_config",
           "merge_user_table", "schedule_words", "unfilled_auto", "without_redacted"]

# DeepSpeed's schedulers (deepspeed.runtime.lr_schedules) and the parameters each takes: a ds_config.json's
# "scheduler" reaches DeepSpeed as written, and DeepSpeed builds it, so a run trains DeepSpeed's own schedule.
SCHEDULER_PARAMS: dict[str, tuple[str, ...]] = {
    "WarmupLR": ("warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type", "last_batch_iteration"),
    "WarmupDecayLR": ("total_num_steps", "warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type",
                      "last_batch_iteration"),
    "WarmupCosineLR": ("total_num_steps", "warmup_min_ratio", "warmup_num_steps", "cos_min_ratio", "warmup_type",
                       "last_batch_iteration"),
    "OneCycle": ("cycle_min_lr", "cycle_max_lr", "decay_lr_rate", "cycle_first_step_size", "cycle_second_step_size",
                 "cycle_first_stair_count", "cycle_second_stair_count", "decay_step_size", "cycle_momentum",
                 "cycle_min_mom", "cycle_max_mom", "decay_mom_rate", "last_batch_iteration"),
    "LRRangeTest": ("lr_range_test_min_lr", "lr_range_test_step_size", "lr_range_test_step_rate",
                    "lr_range_test_staircase", "last_batch_iteration"),
}
# zero_optimization keys whose "auto" the Hugging Face integration fills from the model's hidden size h
# (reduce_bucket_size is hpc_train's zero.bucket_size: its "auto" is that key's value)
HIDDEN_SIZE_KEYS = {"stage3_prefetch_bucket_size": lambda h: int(0.9 * h * h),
                    "stage3_param_persistence_threshold": lambda h: 10 * h}
# a scheduler's parameters whose "auto" is filled from the job's keys (the Hugging Face integration's rule)
AUTO_SCHEDULE_KEYS = ("warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "total_num_steps")
# a ds_config.json scheduler's values that are also typed keys (ds_import reads them in): --set of those wins
_MIRRORED = {"warmup_max_lr": "lr", "warmup_num_steps": "warmup_steps", "warmup_min_lr": "min_lr"}
_QUIET = 10**9  # DeepSpeed prints nothing of its own per step: hpc_train logs progress (a user's value wins)
# Every rank names every DeepSpeed checkpoint with one fixed tag (checkpoint.names.DEEPSPEED_TAG), so DeepSpeed's
# check that the ranks agree on it can find nothing, and costs two all-reduces inside each save call
_TAG_VALIDATION = "Ignore"


def deepspeed_config(config: JobConfig, data_parallel: int, hidden_size: int | None = None) -> dict[str, Any]:
    """The DeepSpeed JSON for a resolved job config (``plan.config``), every ``"auto"`` filled as the Hugging Face
    integration fills it (:func:`_fill_auto`); ``hidden_size``: the model's, for the keys that depend on it (None
    on the login node, where a model of the user's is not built: those stay ``"auto"`` until the ranks)."""
    train, zero = config.train, config.zero
    stage = zero.stage
    ds: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": train.micro_batch,
        "gradient_accumulation_steps": train.grad_accum,
        "train_batch_size": train.micro_batch * train.grad_accum * data_parallel,
        "gradient_clipping": train.grad_clip,
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
    merged = merge_user_table(ds, without_redacted(config.deepspeed))
    merged.setdefault("steps_per_print", _QUIET)
    if isinstance(merged.setdefault("checkpoint", {}), dict):  # a user's own value wins
        merged["checkpoint"].setdefault("tag_validation", _TAG_VALIDATION)
    return _fill_auto(merged, config, hidden_size)


def _fill_auto(ds: dict[str, Any], config: JobConfig, hidden_size: int | None) -> dict[str, Any]:
    """The ``"auto"`` values the typed keys do not already give, filled by the Hugging Face integration's rules:
    a scheduler's warm-up floor 0, its peak ``train.lr``, its warm-up ``train.warmup_steps`` (at least 1) and its
    total ``train.steps``; the ZeRO-3 sizes from the model's hidden size (:data:`HIDDEN_SIZE_KEYS`)."""
    train = config.train
    params = ds.get("scheduler", {}).get("params", {}) if isinstance(ds.get("scheduler"), dict) else {}
    fills = dict(zip(AUTO_SCHEDULE_KEYS, (0, train.lr, max(1, train.warmup_steps), train.steps), strict=True))
    for key, value in params.items():
        if value == "auto" and key in fills:
            params[key] = fills[key]
        elif key in _MIRRORED and train.deepspeed_config:  # the file's value, or what --set gave its typed key
            params[key] = getattr(train, _MIRRORED[key])
    zero = ds.get("zero_optimization", {})
    if hidden_size is not None and isinstance(zero, dict):
        for key, rule in HIDDEN_SIZE_KEYS.items():
            if zero.get(key) == "auto":
                zero[key] = rule(hidden_size)
    return ds


def check_scheduler(scheduler: Any, where: str) -> None:
    """ConfigError unless ``scheduler`` (a DeepSpeed config's ``"scheduler"``) is one DeepSpeed builds: one of its
    types, only that type's parameters, and ``"auto"`` only where it is filled (:data:`AUTO_SCHEDULE_KEYS`).
    ``where`` prefixes the key in messages (``ds_config.json: `` or ``deepspeed.``)."""
    if scheduler is None:
        return
    kind = scheduler.get("type") if isinstance(scheduler, dict) else None
    if not isinstance(kind, str) or kind not in SCHEDULER_PARAMS:  # a list or an object: not a name (fuzz 614)
        raise ConfigError(f"{where}scheduler.type", f'"{str(kind)[:80]}" is not one of DeepSpeed\'s schedulers',
                          f"use one of {', '.join(SCHEDULER_PARAMS)} (deepspeed.runtime.lr_schedules)")
    taken = SCHEDULER_PARAMS[str(kind)]
    params = scheduler.get("params", {})
    extra = [key for key in scheduler if key not in ("type", "params")]
    if extra or not isinstance(params, dict):
        raise ConfigError(f"{where}scheduler.{extra[0] if extra else 'params'}", "is not part of a DeepSpeed "
                          "scheduler", 'write {"type": ..., "params": {...}}')
    for key, value in params.items():
        if key not in taken:
            raise ConfigError(f"{where}scheduler.params.{key}", f"is not a parameter of DeepSpeed's {kind}",
                              f"its parameters: {', '.join(taken)}")
        if value == "auto" and key not in AUTO_SCHEDULE_KEYS:
            raise ConfigError(f"{where}scheduler.params.{key}", '"auto" has no value to take here (the Hugging Face '
                              f"integration fills only {', '.join(AUTO_SCHEDULE_KEYS)})", "give the number")


def unfilled_auto(ds: dict[str, Any]) -> list[str]:
    """The keys still ``"auto"`` (DeepSpeed itself would refuse them), as ``section.key``."""
    found: list[str] = []

    def walk(node: Any, where: str) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                walk(value, f"{where}.{key}" if where else str(key))
        elif node == "auto":
            found.append(where)

    walk(ds, "")
    return found


def schedule_words(config: JobConfig) -> str:
    """The learning-rate schedule in the words of what trains it: DeepSpeed's scheduler with its parameters as
    DeepSpeed names them, or hpc_train's warm-up and decay."""
    scheduler = deepspeed_config(config, 1).get("scheduler") if config.train.engine == "deepspeed" else None
    train = config.train
    if not isinstance(scheduler, dict):
        return f"{train.warmup_steps} warm-up steps, then {train.decay} to {train.min_lr:g}"
    kind, params = scheduler.get("type", "?"), scheduler.get("params", {})
    shown = ", ".join(f"{key}={value}" for key, value in params.items())
    if "warmup_type" in SCHEDULER_PARAMS.get(str(kind), ()) and "warmup_type" not in params:
        shown += (", " if shown else "") + "warmup_type=log (DeepSpeed's default)"
    what = {"WarmupLR": "warm up, then hold", "WarmupDecayLR": "warm up, then linear decay to 0 at total_num_steps",
            "WarmupCosineLR": "warm up, then cosine to cos_min_ratio x lr at total_num_steps",
            "OneCycle": "one cycle between cycle_min_lr and cycle_max_lr, then decay",
            "LRRangeTest": "a learning-rate range test: rising from lr_range_test_min_lr"}.get(str(kind), "")
    return f"DeepSpeed {kind}({shown})" + (f": {what}" if what else "")


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
