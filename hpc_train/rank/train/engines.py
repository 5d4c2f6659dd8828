"""The seam between the trainer and what trains the model: one small interface an engine implements, and the
engines there are (DeepSpeed, and PyTorch's FSDP2). The trainer's loop, data path, monitor, health checks and the
runtime's stop, watchdog and checkpoint transaction are the same for every engine; an engine brings only what it
alone knows (``docs/architecture.md``: what a second engine gets for free)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from hpc_train.common.topology import Topology
from hpc_train.config.plan import Plan
from hpc_train.errors import ConfigError
from hpc_train.rank.distributed.mesh import ParallelGroups

__all__ = ["ENGINES", "EngineCheckpoints", "EngineKind", "Stepping", "engine_kind"]


class Stepping(Protocol):
    """What the loop calls on a built engine: the forward (``engine(*inputs)``), ``backward`` of a micro-batch's
    loss, ``step`` at each micro-batch (the engine knows the accumulation boundary), the rate and the gradient
    norm for the log, ``train``/``eval`` around an evaluation, and the device it computes on."""

    device: torch.device

    def __call__(self, *inputs: Any) -> Any: ...

    def backward(self, loss: torch.Tensor) -> Any: ...

    def step(self) -> Any: ...

    def get_lr(self) -> list[float]: ...

    def get_global_grad_norm(self) -> float | None: ...

    def train(self, mode: bool = True) -> Any: ...

    def eval(self) -> Any: ...


class EngineCheckpoints(Protocol):
    """An engine's side of a checkpoint, over the runtime's transaction
    (:class:`hpc_train.checkpoint.transaction.CheckpointTransaction`): what its ranks write into the folder rank 0
    opened, and how a later attempt loads the newest that verifies (the step and the sampler's position)."""

    def time_saves(self, node_mtbf_hours: float, nodes: int) -> None: ...

    def due(self, step: int, last: int) -> bool: ...

    def saved(self, step: int, seconds: float) -> None: ...

    def save(self, engine: Any, step: int, sampler_state: dict[str, int], wait: bool = False) -> None: ...

    def memory_due(self, step: int) -> bool: ...

    def save_to_memory(self, engine: Any, step: int, sampler_state: dict[str, int]) -> None: ...

    def resume(self, engine: Any) -> tuple[int, dict[str, int] | None]: ...

    def finish(self) -> None: ...

    def close(self) -> None: ...


class EngineKind(Protocol):
    """One engine: built from the model, the job and hpc_train's groups; its checkpoints."""

    name: str

    def build(self, model: torch.nn.Module, plan: Plan, topology: Topology, groups: ParallelGroups,
              run_dir: Path, local_rank: int | None) -> Stepping: ...

    def checkpoints(self, plan: Plan, run_dir: Path, log: Any) -> EngineCheckpoints: ...


@dataclass(frozen=True)
class _DeepSpeed:
    """DeepSpeed ZeRO 0-3 (and its pipeline engine when ``parallel.pipeline > 1``) from the typed config."""

    name: str = "deepspeed"

    def build(self, model: torch.nn.Module, plan: Plan, topology: Topology, groups: ParallelGroups,
              run_dir: Path, local_rank: int | None) -> Stepping:
        from hpc_train.rank.distributed.mesh import ModelParallelUnit
        from hpc_train.rank.train.engine import build_engine

        pipelined = topology.sizes["pp"] > 1  # DeepSpeed's pipeline engine brings its own grid: no mpu
        return build_engine(model, plan.config, topology.sizes["dp"],
                            None if pipelined else ModelParallelUnit(groups), run_dir, local_rank)

    def checkpoints(self, plan: Plan, run_dir: Path, log: Any) -> EngineCheckpoints:
        from hpc_train.checkpoint.deepspeed import Checkpointer

        return Checkpointer(run_dir, plan.config, plan.layout, plan.config_hash, log=log)


@dataclass(frozen=True)
class _Fsdp2:
    """PyTorch FSDP2 over the data axis, with DCP checkpoints that reshard on load (:mod:`engine_fsdp2`)."""

    name: str = "fsdp2"

    def build(self, model: torch.nn.Module, plan: Plan, topology: Topology, groups: ParallelGroups,
              run_dir: Path, local_rank: int | None) -> Stepping:
        import torch.distributed as dist

        from hpc_train.rank.train.engine_fsdp2 import Fsdp2Engine

        on_gpu = dist.get_backend() == "nccl"
        device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
        return Fsdp2Engine(model, plan, groups, device)

    def checkpoints(self, plan: Plan, run_dir: Path, log: Any) -> EngineCheckpoints:
        from hpc_train.checkpoint.fsdp2 import Fsdp2Checkpoints

        return Fsdp2Checkpoints(run_dir, plan.config, plan.layout, plan.config_hash, log=log)


ENGINES: dict[str, EngineKind] = {"deepspeed": _DeepSpeed(), "fsdp2": _Fsdp2()}


def engine_kind(name: str) -> EngineKind:
    """The engine called ``name``; a ConfigError naming the ones there are otherwise."""
    if name not in ENGINES:
        raise ConfigError("train.engine", f'"{name}" is not an engine', f"use one of: {', '.join(ENGINES)}")
    return ENGINES[name]
