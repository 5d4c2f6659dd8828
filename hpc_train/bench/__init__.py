"""Communication benchmarks: how fast the job's ranks really talk, in nccl-tests' terms (see :mod:`.collectives`)."""

from hpc_train.bench.collectives import (
           OPS,
           BenchError,
           NotSupportedError,
           Result,
           bandwidths,
           bus_factor,
           measure,
           transport_from_nccl_log,
)

__all__ = ["OPS", "BenchError", "NotSupportedError", "Result", "bandwidths", "bus_factor", "measure",
           "transport_from_nccl_log"]
