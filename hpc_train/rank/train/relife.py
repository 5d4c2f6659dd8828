"""What a rank's process lets go of between two lives when it trains the next one itself (a warm restart,
:mod:`hpc_train.rank.entry`): the process group a failure broke, DeepSpeed's record of the groups, the old
life's objects. What it keeps is what makes it warm: the imports, compiled code, the CUDA context.

DeepSpeed keeps its communication backend and its groups in module globals (``deepspeed.comm.comm.cdb``,
``deepspeed.utils.groups``): left as they are, the next life's engine would find the old groups, destroyed, and
reuse them. They are put back as DeepSpeed's import leaves them.
"""

from __future__ import annotations

import contextlib
import gc
from typing import Any

__all__ = ["end_life", "forget_groups", "free_heap", "life_released", "mark_released", "release_life"]

_RELEASED = "hpc_train_life_released"  # set on the error a life failed with, once that life was let go of

# deepspeed.utils.groups' globals, as its import sets them, for a DeepSpeed without _release_process_group_references
_DEEPSPEED_GROUPS: dict[str, Any] = {
    "_EXPERT_PARALLEL_GROUP": {}, "_EXPERT_PARALLEL_GROUP_RANKS": {}, "_EXPERT_DATA_PARALLEL_GROUP": {},
    "_EXPERT_DATA_PARALLEL_GROUP_RANKS": {}, "_WORLD_GROUP": None, "_ZERO_PARAM_INTRA_PARALLEL_GROUP": None,
    "mpu": None, "expert_tensor_parallel_world_size": 1, "_ALL_TO_ALL_GROUP": {},
    "_TENSOR_MODEL_PARALLEL_GROUP": None, "_MODEL_PARALLEL_GROUP": None, "_DATA_PARALLEL_GROUP": None,
    "_MPU_TENSOR_MODEL_PARALLEL_WORLD_SIZE": None, "_MPU_TENSOR_MODEL_PARALLEL_RANK": None,
}


def end_life(engine: Any) -> None:
    """A failed life's engine and groups, let go of where the failure happened (in the trainer, every failure):
    NCCL's communicators aborted first (nothing waits on a dead peer), then the engine's hooks on the parameters
    removed while its groups still answer (DeepSpeed's ``destroy``: C++ references the collector cannot see,
    which would keep the whole engine alive), then every group destroyed. Each step is best effort: the process
    may be on its way out anyway."""
    from hpc_train.rank.distributed.bootstrap import abort_nccl, shutdown

    destroy = getattr(engine, "destroy", None)
    for step in (abort_nccl, *((destroy,) if callable(destroy) else ()), shutdown):
        try:
            step()
        except Exception:  # noqa: S112 - a broken group or engine is what is being let go of
            continue


def mark_released(error: BaseException) -> None:
    """Say on ``error`` that the life it ended has been let go of (:func:`end_life` ran): only then may its
    process train the next life. An error that takes no attribute stays unmarked (the rank then starts anew)."""
    with contextlib.suppress(AttributeError, TypeError):
        setattr(error, _RELEASED, True)


def life_released(error: BaseException) -> bool:
    """Whether the life ``error`` ended was let go of: a failure before the engine was whole (a peer's death inside
    ``deepspeed.initialize`` leaves a half-built engine that nothing can free) is not, and its rank starts anew."""
    return getattr(error, _RELEASED, False) is True


def forget_groups() -> None:
    """Leave the broken process group (a no-op where the trainer's :func:`end_life` did already) and forget
    DeepSpeed's record of the groups: fast, so a warm rank does it before it tells its agent."""
    from hpc_train.rank.distributed.bootstrap import abort_nccl, shutdown

    abort_nccl()
    shutdown()
    _forget_deepspeed_groups()


def release_life() -> None:
    """Everything a failed life leaves once its stack is unwound: its groups (:func:`forget_groups`), then its
    objects and device memory (:func:`free_heap`)."""
    forget_groups()
    free_heap()


def free_heap() -> None:
    """Free the old life's objects (the heap frozen after set-up, :mod:`hpc_train.rank.runtime.heap`, is
    unfrozen first: its engine is garbage now) and the device memory they held."""
    import torch

    gc.unfreeze()
    gc.collect()
    if torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def _forget_deepspeed_groups() -> None:
    import sys

    comm = sys.modules.get("deepspeed.comm.comm")
    if comm is not None:
        comm.cdb = None  # type: ignore[attr-defined]
    groups = sys.modules.get("deepspeed.utils.groups")
    if groups is not None and callable(getattr(groups, "_release_process_group_references", None)):
        groups._release_process_group_references(None)  # DeepSpeed's own, where it has one (0.19 does)
    elif groups is not None:
        for name, value in _DEEPSPEED_GROUPS.items():
            if hasattr(groups, name):
                setattr(groups, name, type(value)() if isinstance(value, dict) else value)
