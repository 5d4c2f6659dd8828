"""The topology as torch objects: a DeviceMesh with named axes, a process group per axis, and the
model-parallel unit (``mpu``) that ``deepspeed.initialize`` takes. Everything is held by one object, never in
module globals, so two layouts can live in one process (tests do exactly that)."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from hpc_train.common.topology import AXES, Topology

__all__ = ["ModelParallelUnit", "ParallelGroups"]


class ParallelGroups:
    """A process group per axis of ``topology`` for this rank, from a DeviceMesh named after the axes."""

    def __init__(self, topology: Topology, device_type: str = "cpu") -> None:
        if dist.get_world_size() != topology.world:
            raise ValueError(f"the process group has {dist.get_world_size()} ranks but the topology {topology.world};"
                             " build the topology from the job's world size")
        self.topology = topology
        self.rank = dist.get_rank()
        outer_first = tuple(reversed(topology.order))  # DeviceMesh: the last dimension is innermost
        self.mesh: DeviceMesh = init_device_mesh(device_type, tuple(topology.sizes[a] for a in outer_first),
                                                 mesh_dim_names=outer_first)
        self._groups: dict[tuple[str, ...], Any] = {(axis,): self.mesh.get_group(axis) for axis in AXES}
        self._groups[("cp", "dp")] = self._combined(("cp", "dp"))

    def _combined(self, axes: tuple[str, ...]) -> Any:
        """A group over several axes (data x context for ZeRO when sequences are split); every rank creates all."""
        wide = [axis for axis in axes if self.topology.sizes[axis] > 1]
        if len(wide) <= 1:
            return self._groups[(wide[0] if wide else axes[0],)]
        mine = None
        for ranks in self.topology.groups(*axes):
            group = dist.new_group(ranks)
            if self.rank in ranks:
                mine = group
        return mine

    def group(self, *axes: str) -> Any:
        """The process group of this rank along ``axes`` (one axis, or ``"cp", "dp"``)."""
        key = tuple(sorted(axes))
        if key not in self._groups:
            raise ValueError(f"no group for axes {axes}; valid: {', '.join(AXES)} and ('cp', 'dp')")
        return self._groups[key]

    def size(self, axis: str) -> int:
        return self.topology.sizes[axis]

    def coord(self, axis: str) -> int:
        return self.topology.coords(self.rank)[axis]

    def ranks(self, *axes: str) -> list[int]:
        """Global ranks of this rank's group along ``axes``."""
        return dist.get_process_group_ranks(self.group(*axes))


class ModelParallelUnit:
    """What DeepSpeed asks an ``mpu`` for: tensor (model), pipeline, sequence (context) and data groups."""

    def __init__(self, groups: ParallelGroups) -> None:
        self.groups = groups

    def get_model_parallel_group(self) -> Any:
        return self.groups.group("tp")

    def get_model_parallel_rank(self) -> int:
        return self.groups.coord("tp")

    def get_model_parallel_world_size(self) -> int:
        return self.groups.size("tp")

    get_tensor_model_parallel_group = get_model_parallel_group
    get_tensor_model_parallel_rank = get_model_parallel_rank
    get_tensor_model_parallel_world_size = get_model_parallel_world_size

    def get_tensor_model_parallel_src_rank(self) -> int:
        return self.groups.ranks("tp")[0]

    def get_data_parallel_group(self) -> Any:
        return self.groups.group("dp")

    def get_data_parallel_rank(self) -> int:
        return self.groups.coord("dp")

    def get_data_parallel_world_size(self) -> int:
        return self.groups.size("dp")

    def get_data_parallel_group_ranks(self) -> list[int]:
        return self.groups.ranks("dp")

    def get_pipe_parallel_group(self) -> Any:
        return self.groups.group("pp")

    def get_pipe_parallel_rank(self) -> int:
        return self.groups.coord("pp")

    def get_pipe_parallel_world_size(self) -> int:
        return self.groups.size("pp")

    get_pipeline_model_parallel_group = get_pipe_parallel_group
    get_pipeline_model_parallel_rank = get_pipe_parallel_rank
    get_pipeline_model_parallel_world_size = get_pipe_parallel_world_size

    def get_sequence_parallel_group(self) -> Any:
        return self.groups.group("cp")

    def get_sequence_parallel_rank(self) -> int:
        return self.groups.coord("cp")

    def get_sequence_parallel_world_size(self) -> int:
        return self.groups.size("cp")

    def get_sequence_data_parallel_group(self) -> Any:
        return self.groups.group("cp", "dp")

    def get_sequence_data_parallel_rank(self) -> int:
        return dist.get_rank(self.get_sequence_data_parallel_group())

    def get_sequence_data_parallel_world_size(self) -> int:
        return self.groups.size("cp") * self.groups.size("dp")
