"""Saving and resuming a training run through the transactional checkpoint manager.

Every rank writes its DeepSpeed shards and its own random state into the temporary folder rank 0 opened;
after a barrier rank 0 seals it (manifest, rename, ``latest``). On start, rank 0 picks the newest checkpoint
that verifies and every rank loads it: the model, optimizer and scheduler through DeepSpeed, the sampler's
position and the step from the client state, and each rank's Python and torch random state.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from hpc_train.ckpt import CheckpointManager

__all__ = ["TAG", "Checkpointer"]

TAG = "state"  # DeepSpeed's tag inside a checkpoint folder: the folder name already says the step


def _broadcast(value: Any) -> Any:
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


class Checkpointer:
    """Rank 0 owns the checkpoint folder (one writer); every rank takes part in each save and load."""

    def __init__(self, run_dir: Path, config: dict[str, Any], layout: Any, config_hash: str) -> None:
        checkpoint = config["checkpoint"]
        self.every = checkpoint["every_steps"]
        self.resume_enabled = checkpoint["resume"]
        self.rank = dist.get_rank()
        self.manager = CheckpointManager(run_dir / "checkpoints", keep=checkpoint["keep"],
                                         verify=checkpoint["verify"]) if self.rank == 0 else None
        self.fields = {"world_size": layout.world, "zero_stage": config["zero"]["stage"],
                       "dtype": config["train"]["precision"], "config_hash": config_hash,
                       "layout": {"tensor": layout.tensor, "pipeline": layout.pipeline, "data": layout.data,
                                  "context": layout.context}}

    def due(self, step: int, last: int) -> bool:
        return step == last or bool(self.every and step % self.every == 0)

    def save(self, engine: Any, step: int, sampler_state: dict[str, int]) -> None:
        tmp = Path(_broadcast(str(self.manager.begin(step)) if self.manager else None))
        engine.save_checkpoint(str(tmp), tag=TAG, client_state={"step": step, "sampler": sampler_state})
        rng = tmp / "rng"
        if self.rank == 0:
            rng.mkdir(exist_ok=True)
        dist.barrier()
        torch.save({"python": random.getstate(), "torch": torch.get_rng_state()}, rng / f"rank-{self.rank}.pt")
        dist.barrier()  # every rank's files are on disk before rank 0 seals the folder
        if self.manager:
            self.manager.commit(tmp, {"step": step, **self.fields})
        dist.barrier()

    def resume(self, engine: Any) -> tuple[int, dict[str, int] | None]:
        """(the last completed step, the sampler state) of the newest good checkpoint, or (0, None)."""
        if not self.resume_enabled:
            return 0, None
        found = _broadcast(str(path) if self.manager and (path := self.manager.latest_verified()) else None)
        if found is None:
            return 0, None
        _, client = engine.load_checkpoint(found, tag=TAG)
        rng_file = Path(found) / "rng" / f"rank-{self.rank}.pt"
        if rng_file.exists():
            state = torch.load(rng_file, weights_only=True)
            random.setstate(state["python"])
            torch.set_rng_state(state["torch"])
        return int(client["step"]), client["sampler"]
