"""Every random generator a rank may draw from, saved into a checkpoint and restored from it: Python's, NumPy's
global one, torch's CPU generator and, on a GPU rank, the CUDA generator of its device. The trainer's checkpoints
(``rng/ranks-FIRST-LAST.pt``, one per node) and a program's ``ctx.checkpoint`` both hold it: dropout on a GPU draws
from the CUDA generator, so without it a resumed run is not the run it continues.

Saved as tensors and plain numbers only, so the file loads with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import random
from typing import Any

import torch

__all__ = ["capture", "restore"]


def _numpy_state() -> dict[str, Any] | None:
    try:
        import numpy as np
    except ImportError:
        return None
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    return {"kind": kind, "keys": torch.from_numpy(keys.astype("int64")), "pos": int(pos),
            "has_gauss": int(has_gauss), "cached_gaussian": float(cached)}


def capture(device: torch.device) -> dict[str, Any]:
    """This rank's generators now; ``device`` is the rank's device (its CUDA generator is saved when it is a GPU)."""
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    numpy_state = _numpy_state()
    if numpy_state is not None:
        state["numpy"] = numpy_state
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def restore(state: dict[str, Any], device: torch.device) -> None:
    """Put the generators back as :func:`capture` found them (a generator the file lacks is left as it is)."""
    if "python" in state:
        version, internal, gauss = state["python"]
        random.setstate((version, tuple(internal), gauss))
    if "torch" in state:
        torch.set_rng_state(state["torch"])
    numpy_state = state.get("numpy")
    if numpy_state is not None:
        import numpy as np

        np.random.set_state((numpy_state["kind"], numpy_state["keys"].numpy().astype("uint32"), numpy_state["pos"],
                             numpy_state["has_gauss"], numpy_state["cached_gaussian"]))
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)
