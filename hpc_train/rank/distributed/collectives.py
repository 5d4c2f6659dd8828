"""The collectives hpc_train calls for its own bookkeeping, each with its tensor on the group's device.

Why: NCCL moves CUDA tensors only, and gloo CPU tensors only. A loss, a preemption flag or a timing made on the
CPU and all-reduced over an NCCL group fails with "No backend type associated with device type cpu", on the GPU
cluster and never on a laptop. So no call site picks a device: these helpers build the tensor on the device of
the group's backend and hand back plain Python numbers. ``tests/rank/distributed/test_collective_discipline.py``
fails on a ``torch.distributed`` collective anywhere else in the package. The two exceptions are the
tensor-parallel layers, whose tensors are the model's own activations on its device, and the collective
benchmark, which measures on the device it names.

Why not one process group with a backend per device (``"cpu:gloo,cuda:nccl"``): every group would then hold
a gloo communicator beside its NCCL one, which means another set of sockets per rank per group. DeepSpeed and
torch's NCCL watchdog read the backend by its name. And a collective on a CPU tensor would silently take the
slow path where it should have been on the GPU.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["PendingReduce", "all_gather_objects", "all_gather_values", "all_reduce_values", "barrier",
           "broadcast_object", "device_for_backend", "gather_bytes", "gather_objects", "group_device"]

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


def device_for_backend(backend: str) -> torch.device:
    """The device a collective of ``backend`` moves: NCCL the current CUDA device, anything else the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")


def group_device(group: Any = None) -> torch.device:
    """The device of ``group``'s backend (the default group when None)."""
    return device_for_backend(str(dist.get_backend(group)))


def _tensor(values: Sequence[float | int], dtype: torch.dtype, group: Any) -> torch.Tensor:
    return torch.tensor(list(values), dtype=dtype, device=group_device(group))


def all_reduce_values(values: Sequence[float | int], op: str = "sum", group: Any = None,
                      dtype: torch.dtype = torch.float64) -> list[Any]:
    """``values`` reduced element-wise over ``group`` (``op`` is sum, max or min), as Python numbers."""
    tensor = _tensor(values, dtype, group)
    dist.all_reduce(tensor, op=_OPS[op], group=group)
    return tensor.tolist()


class PendingReduce:
    """An all-reduce of a few numbers in flight: started now, read with :meth:`wait` later, so a step does not
    wait for the round trip (the preemption and stop flags)."""

    def __init__(self, values: Sequence[int], op: str = "max", group: Any = None) -> None:
        self._tensor = _tensor(values, torch.int64, group)
        self._work = dist.all_reduce(self._tensor, op=_OPS[op], group=group, async_op=True)

    def wait(self) -> list[int]:
        self._work.wait()
        return [int(value) for value in self._tensor.tolist()]


def all_gather_values(values: Sequence[float], group: Any = None) -> list[list[float]]:
    """Every rank's ``values`` (the same length on each), in rank order."""
    mine = _tensor(values, torch.float64, group)
    gathered = [torch.zeros_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, mine, group=group)
    return [tensor.tolist() for tensor in gathered]


def broadcast_object(value: Any, src: int = 0, group: Any = None) -> Any:
    """``value`` of rank ``src`` on every rank (torch pickles it through the group's device)."""
    box = [value]
    dist.broadcast_object_list(box, src=src, group=group, device=group_device(group))
    return box[0]


def all_gather_objects(value: Any, group: Any = None) -> list[Any]:
    """Every rank's ``value``, in rank order."""
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, value, group=group)
    return gathered


def gather_objects(value: Any, dst: int = 0, group: Any = None) -> list[Any] | None:
    """Every rank's ``value`` on rank ``dst`` (in rank order); None on the others."""
    gathered: list[Any] | None = [None] * dist.get_world_size(group) if dist.get_rank() == dst else None
    dist.gather_object(value, gathered, dst=dst, group=group)
    return gathered


def gather_bytes(data: bytes, dst: int, group: Any = None) -> list[bytes] | None:
    """Every rank's ``data`` (any length, none included) on global rank ``dst``, in the group's rank order; None
    on the others. The bytes travel as uint8 tensors on the group's device, padded to the longest (no pickle:
    the receiver decides how to read them)."""
    device = group_device(group)
    count = dist.get_world_size(group)
    sizes = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(count)]
    dist.all_gather(sizes, torch.tensor([len(data)], dtype=torch.int64, device=device), group=group)
    lengths = [int(size.item()) for size in sizes]
    mine = torch.zeros(max(1, *lengths), dtype=torch.uint8)
    if data:
        mine[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    mine = mine.to(device)
    received = [torch.empty_like(mine) for _ in range(count)] if dist.get_rank() == dst else None
    dist.gather(mine, received, dst=dst, group=group)
    if received is None:
        return None
    return [bytes(tensor[:length].cpu().numpy()) for tensor, length in zip(received, lengths, strict=True)]


def barrier(group: Any = None) -> None:
    """Wait for every rank of ``group``; on NCCL on this rank's own GPU (a barrier guesses one otherwise)."""
    if str(dist.get_backend(group)) == "nccl":
        dist.barrier(group=group, device_ids=[torch.cuda.current_device()])
    else:
        dist.barrier(group=group)
