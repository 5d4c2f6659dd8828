"""FSDP2's side of a checkpoint, inside the runtime's transaction (:mod:`hpc_train.checkpoint.transaction`: the folder
rank 0 opens, the manifest with every file's size and sha256, the rename, ``latest`` last, ``ckpt ls/verify``).

The model and optimizer go through ``torch.distributed.checkpoint`` (``get_state_dict`` / ``set_state_dict`` with
``StateDictOptions``) into ``dcp/`` of the step folder: every rank writes its own shards, and a later attempt loads
them at any data-parallel size, DCP resharding on load with no conversion step. The step, the sampler's global
position and the schedule are the same on every rank; each rank's random state is its own
(``ranks/rank-N.pt``, written through the rank's hashed files). A rank that did not exist when the checkpoint
was saved reads rank 0's step, sampler and schedule and keeps its freshly seeded random state, as the DeepSpeed
path does.

With ``checkpoint.async_save`` (the default) the shards go through ``dcp.async_save``: the state is copied to
host memory on the step, and DCP writes it in a thread of its own, on a gloo group made for it alone (DCP's
asynchronous save needs a CPU group, and a barrier on the group a background save uses deadlocks; nothing else
uses this one). Each rank's writer thread waits for DCP's future before it writes the rank's marker, so rank 0
commits only once every shard is on disk; the save after a stop signal is synchronous. The shards are hashed
while DCP writes them (:mod:`hpc_train.checkpoint.dcp_files`), so the commit reads none of them back.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hpc_train.checkpoint import MANIFEST_NAME, CheckpointError, Manifest
from hpc_train.checkpoint.transaction import CheckpointTransaction
from hpc_train.rank.distributed.collectives import all_gather_objects
from hpc_train.rank.runtime import random_state

__all__ = ["DCP_DIR", "Fsdp2Checkpoints"]

from hpc_train.checkpoint.dcp_state import DCP_DIR

RANKS_DIR = "ranks"


def _dcp_failure(error: BaseException) -> str:
    """The failure DCP reports from a rank (its message holds every failed rank's whole traceback)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return lines[-1] if lines else type(error).__name__


def _done(future: Any) -> Any:
    """What DCP's asynchronous save returned (a Future, or a response holding the upload's future), waited on."""
    return getattr(future, "upload_completion", future).result()


class Fsdp2Checkpoints(CheckpointTransaction):
    """The trainer's save and resume for an :class:`~hpc_train.rank.train.engine_fsdp2.Fsdp2Engine`."""

    ENGINE = "fsdp2"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        import torch.distributed as dist

        super().__init__(*args, **kwargs)
        # Collective: every rank builds its checkpointer at the same point of the build stage.
        self._save_group = dist.new_group(backend="gloo") if self.async_save else None
        self._stager: Any = None  # made at the first asynchronous save, kept for the run

    def save(self, engine: Any, step: int, sampler_state: dict[str, int], wait: bool = False) -> None:
        """Every rank's shards through DCP (in the background unless ``wait`` or a synchronous config), and its
        own small file."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.api import CheckpointException
        from torch.distributed.checkpoint.state_dict import get_state_dict

        def write(tmp: Path) -> None:
            from hpc_train.checkpoint.dcp_files import hashing_writer, host_stager

            model, optimizer = get_state_dict(engine.module, engine.optimizer)
            state, where = {"model": model, "optimizer": optimizer}, tmp / DCP_DIR
            writer = hashing_writer(where, tmp, self.files.entries)  # this save's list: begin() made it
            if self.files.staging:
                self._stager = self._stager or host_stager(engine.device.type == "cuda")
                future = dcp.async_save(state, storage_writer=writer, checkpoint_id=str(where),
                                        process_group=self._save_group, async_stager=self._stager)
                self.files.after(lambda: _done(future))
            else:
                try:
                    dcp.save(state, storage_writer=writer, checkpoint_id=str(where))
                except CheckpointException as error:  # a BaseException: past every "except Exception"
                    raise CheckpointError(f"{where}: DCP could not write the shards: {_dcp_failure(error)}") from None
            node = self.node_states.gather_later(lambda: {  # the node's ranks' states, one file per node
                "step": step, "sampler": sampler_state, "scheduler": engine.scheduler.state_dict(),
                "random": random_state.capture(engine.device)})
            if node is not None:
                self.files.save_built(node, tmp / RANKS_DIR / self.node_states.file_name)

        self.save_with(step, write, wait=wait)

    def resume(self, engine: Any) -> tuple[int, dict[str, int] | None]:
        """(the last completed step, the sampler state) of the newest good checkpoint, or (0, None).

        Rank 0 picks the newest checkpoint whose files have the manifest's sizes; every rank then reads the
        shards DCP asks it for and its node's small file (``ranks/ranks-A-B.pt``) once each, checking each one's
        sha256 on the way with ``checkpoint.verify = "sha256"``. A damaged file is found by the rank that read it,
        the ranks agree, and all of them load the previous checkpoint over it (as the DeepSpeed path does)."""
        damaged: list[Path] = []
        while True:
            found = self.latest("size", damaged)
            if found is None:
                if damaged:
                    raise CheckpointError(f"every checkpoint failed verification while it was loaded ("
                                          f"{', '.join(path.name for path in damaged)}); the model is partly "
                                          "loaded, so the run stops: set checkpoint.resume = false to start over")
                return 0, None
            problem, shared, mine = self._load(engine, found)
            problems = [p for p in all_gather_objects(problem) if p]
            if not problems:
                break
            self.log(f"warning: checkpoint {found.name} skipped: {problems[0]}; falling back to the previous one")
            damaged.append(found)
        steps = {int(step) for step in all_gather_objects(int(shared["step"]))}
        if len(steps) != 1:
            raise CheckpointError(f"{found}: the ranks' files hold different steps {sorted(steps)}")
        engine.scheduler.load_state_dict(shared["scheduler"])
        if mine:
            random_state.restore(shared["random"], engine.device)
        self.log(f"resumed from step {shared['step']} ({found.name}, FSDP2 shards resharded by DCP as needed)")
        return int(shared["step"]), shared["sampler"]

    def _load(self, engine: Any, found: Path) -> tuple[str | None, dict[str, Any], bool]:
        """Load ``found`` into the engine on this rank: (what was wrong with its files, or None; the rank's
        small file, or rank 0's for a rank the checkpoint did not have; whether it was this rank's own)."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.api import CheckpointException
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        from hpc_train.checkpoint.dcp_files import checking_reader

        entries = list(Manifest.from_json((found / MANIFEST_NAME).read_text(encoding="utf-8")).files)
        problems: list[str] = []
        model, optimizer = get_state_dict(engine.module, engine.optimizer)
        state = {"model": model, "optimizer": optimizer}
        reader = checking_reader(found / DCP_DIR, found, entries, self.check_sha256, problems)
        try:
            dcp.load(state, storage_reader=reader, checkpoint_id=str(found / DCP_DIR))
        except CheckpointException as error:  # DCP's error reaches every rank: a file gone, short, unreadable
            return _dcp_failure(error), {}, False
        set_state_dict(engine.module, engine.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optimizer"])
        self.files.load_problems.clear()
        self.files.begin_load(found, entries, self.check_sha256)
        names = [entry.path.removeprefix(f"{RANKS_DIR}/") for entry in entries
                 if entry.path.startswith(f"{RANKS_DIR}/")]  # the manifest's, not a listing by every rank
        mine = self.node_states.pick(found / RANKS_DIR, self.files.load, names=names)  # None: new since the save
        shared = mine if mine is not None else self.node_states.pick(found / RANKS_DIR, self.files.load, rank=0,
                                                                     names=names)
        problems += self.files.load_problems
        if shared is None:
            return f"checkpoint {found.name} holds no rank's own state in {RANKS_DIR}/", {}, False
        return (problems[0] if problems else None), shared, mine is not None
