"""Rank 0's GPU as NVML sees it on logged steps: utilisation and memory, for the health checks.

Why NVML and not torch: ``torch.cuda.utilization()`` asks NVML too, and torch's memory figures count only its own
allocator, not NCCL's buffers or another process on the GPU. Utilisation is NVML's, the share of its last sample
period (1/6 s to 1 s, by GPU) in which a kernel ran, so a logged step reads the GPU as it trains. The GPU is found
by its UUID (``CUDA_VISIBLE_DEVICES`` renumbers devices, NVML does not). ``nvidia-ml-py`` is an optional extra;
without it, or without a driver, the checks are skipped with one note.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

__all__ = ["GpuReadings"]


class GpuReadings:
    """Reads one GPU through NVML; :meth:`read` is empty when NVML could not start (said once, at start)."""

    def __init__(self, device_index: int, log: Callable[[str], None], uuid: str | None = None) -> None:
        self.handle: Any = None
        self._nvml: Any = None
        try:
            import pynvml
        except ImportError:
            log("health: the GPU utilisation and memory checks are skipped: nvidia-ml-py is missing "
                "(pip install 'hpc_train[nvml]')")
            return
        try:
            pynvml.nvmlInit()
            if uuid:
                self.handle = pynvml.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith("GPU-") else f"GPU-{uuid}")
            else:
                self.handle = pynvml.nvmlDeviceGetHandleByIndex(_physical_index(device_index))
        except pynvml.NVMLError as error:
            log(f"health: the GPU utilisation and memory checks are skipped: NVML could not start ({error})")
            return
        self._nvml = pynvml

    def read(self) -> dict[str, float]:
        """``gpu_utilisation`` (0-1), ``gpu_memory_bytes`` and ``gpu_memory_share`` (of the GPU's total)."""
        if self._nvml is None:
            return {}
        try:
            rates = self._nvml.nvmlDeviceGetUtilizationRates(self.handle)
            memory = self._nvml.nvmlDeviceGetMemoryInfo(self.handle)
        except self._nvml.NVMLError:
            return {}  # a transient NVML error: this logged step has no reading
        return {"gpu_utilisation": rates.gpu / 100, "gpu_memory_bytes": float(memory.used),
                "gpu_memory_share": memory.used / memory.total if memory.total else 0.0}


def _physical_index(logical: int) -> int:
    """NVML's index of torch's device ``logical``: CUDA_VISIBLE_DEVICES lists them (numbers only; UUIDs are looked
    up by the caller)."""
    visible = [item.strip() for item in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if item.strip()]
    if logical < len(visible) and visible[logical].isdigit():
        return int(visible[logical])
    return logical
