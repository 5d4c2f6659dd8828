"""PyTorch Lightning on hpc_train: ``Trainer(callbacks=[HpcTrainCallback()])`` and ``fit(..., ckpt_path="last")``.

After every optimizer step the callback tells hpc_train the Trainer's ``global_step`` and what the module logged
(``self.log``), and asks ``should_stop()`` (collective: every rank, at the same step). When a preemption or
time-limit signal has come, it saves through the Trainer's own checkpointing into the ``ModelCheckpoint``'s
folder as ``last.ckpt`` (so ``ckpt_path="last"`` resumes exactly there) and sets ``trainer.should_stop``: ``fit``
returns on every rank after that step (at an epoch's last batch, after the next one: :func:`ends_epoch`), the
script ends, and hpc_train requeues the job. After that save the ``ModelCheckpoint`` is told it saved this step:
otherwise it writes ``last-v1.ckpt`` at the end of ``fit`` (``save_last`` when it had saved nothing yet) with the
epoch marked done, and ``ckpt_path="last"``, which takes the newest, would skip the rest of the epoch. No step is
lost or trained twice when the train loader is resumable (``torchdata``'s ``StatefulDataLoader``, or any loader with
``state_dict``/``load_state_dict``): Lightning restarts a plain ``DataLoader``'s epoch from its start.

Outside hpc_train (``torchrun train.py``) the callback does nothing. Importing this module imports neither torch
nor Lightning; the class is built from the package the script uses
(``lightning.pytorch`` or ``pytorch_lightning``, whose ``Callback`` classes differ) when it is first named.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

__all__ = ["HpcTrainCallback", "ends_epoch"]  # noqa: F822 - built on first use, by the module's __getattr__

_BUILT: dict[str, type] = {}


def _lightning() -> Any:
    """The Lightning package the script imported; ``lightning.pytorch`` first when it imported neither."""
    for name in ("lightning.pytorch", "pytorch_lightning"):
        if name in sys.modules:
            return sys.modules[name]
    try:
        import lightning.pytorch as pl
    except ImportError:
        import pytorch_lightning as pl
    return pl


def _last_path(trainer: Any, checkpoint_path: str | None) -> Path:
    """Where ``ckpt_path="last"`` looks: the first ``ModelCheckpoint``'s folder, as ``last.ckpt``."""
    if checkpoint_path is not None:
        return Path(checkpoint_path)
    for callback in trainer.checkpoint_callbacks:
        if getattr(callback, "dirpath", None):
            name = f"{callback.CHECKPOINT_NAME_LAST}{callback.FILE_EXTENSION}"
            return Path(callback.dirpath) / name
    return Path(trainer.default_root_dir) / "checkpoints" / "last.ckpt"


def ends_epoch(trainer: Any, batch_idx: int) -> bool:
    """Whether this batch is its epoch's last. A checkpoint taken there does not resume exactly with Lightning 2.6
    and a ``StatefulDataLoader`` (measured: a run resumed from step 16 of 16-step epochs trained other batches
    than the uninterrupted one; from steps 15 and 17 it did not). So the stop waits for the next step, the first
    of the next epoch (every rank alike: the same batch counts); should_stop() goes on saying True there, and a
    run that ends at this batch needs no stop at all."""
    progress = getattr(getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None), "batch_progress", None)
    if getattr(progress, "is_last_batch", False):
        return True
    batches = getattr(trainer, "num_training_batches", float("inf"))
    return isinstance(batches, int) and batch_idx + 1 >= batches


def _build(pl: Any) -> type:
    from hpc_train.integrations.metrics import scalars, started_context

    class HpcTrainCallback(pl.Callback):  # type: ignore[misc, name-defined]
        """Asks ``should_stop()`` after each optimizer step, saves ``last.ckpt`` and stops ``fit`` on a signal;
        reports the step and the logged metrics. ``checkpoint_path``: save there instead (resume from it)."""

        def __init__(self, checkpoint_path: str | None = None) -> None:
            self.checkpoint_path = checkpoint_path
            self.stopped_at: int | None = None
            self._ctx: Any = None
            self._seen_step = -1

        def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
            if stage == "fit":
                self._ctx = started_context()  # collective once: the process group is Lightning's

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            if self._ctx is None:
                return  # not a run hpc_train started
            step = int(trainer.global_step)
            if step == self._seen_step:
                return  # accumulating gradients: no optimizer step, nothing to stop at
            self._seen_step = step
            self._ctx.log(step, **scalars(trainer.callback_metrics))
            if not self._ctx.should_stop() or ends_epoch(trainer, batch_idx):
                return  # at an epoch's last batch the stop waits one step (see ends_epoch)
            path = str(_last_path(trainer, self.checkpoint_path))
            trainer.save_checkpoint(path)
            for callback in trainer.checkpoint_callbacks:  # no ModelCheckpoint saves after this one (see below)
                if hasattr(callback, "_last_global_step_saved"):
                    callback._last_global_step_saved = step
                if hasattr(callback, "_last_checkpoint_saved") and not callback._last_checkpoint_saved:
                    callback._last_checkpoint_saved = path
            self.stopped_at = step
            trainer.should_stop = True

    return HpcTrainCallback


def __getattr__(name: str) -> Any:
    if name != "HpcTrainCallback":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    pl = _lightning()
    if pl.__name__ not in _BUILT:
        _BUILT[pl.__name__] = _build(pl)
    return _BUILT[pl.__name__]
