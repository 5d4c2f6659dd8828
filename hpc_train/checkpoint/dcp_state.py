"""An FSDP2 checkpoint's model, whole again: the ``dcp/`` folder of a step folder
(:mod:`hpc_train.checkpoint.fsdp2`) read without a process group. Export and tests use it; torch is
imported inside the function, so importing this module stays light."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

__all__ = ["DCP_DIR", "dcp_model_state"]

DCP_DIR = "dcp"  # the distributed checkpoint inside a step folder


def dcp_model_state(dcp_dir: Path) -> dict[str, Any]:
    """The ``model`` entry of the distributed checkpoint in ``dcp_dir``, with the module's names: DCP's own
    converter into a private temporary file, read back with ``weights_only=True``."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory(prefix="hpc_train-dcp-") as tmp:
        whole = Path(tmp) / "whole.pt"
        dcp_to_torch_save(str(dcp_dir), str(whole))
        return dict(torch.load(whole, map_location="cpu", weights_only=True)["model"])
