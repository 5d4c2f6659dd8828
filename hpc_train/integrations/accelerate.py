"""accelerate on hpc_train: :class:`Checkpoints` around ``accelerator.save_state`` / ``load_state`` and
``should_stop()``, for the training loop a user writes around an ``Accelerator``::

    checkpoints = Checkpoints(accelerator, "out/checkpoints", every=20)
    step = checkpoints.resume()                      # 0, or the step of the newest complete checkpoint
    for batch in accelerator.skip_first_batches(loader, step % len(loader)):
        ...                                          # forward, accelerator.backward, optimizer.step
        step += 1
        if checkpoints.step_end(step, loss=loss):    # saves every 20 steps, and on a signal; True: stop now
            break

Each checkpoint is ``accelerator.save_state`` into ``step-N``, written under a temporary name and renamed once
every rank has written its part, so a save cut short is never resumed from. On a preemption or time-limit signal
``step_end`` saves the step it was called for and returns True on every rank at the same step: no step lost,
none trained twice. Outside hpc_train the stop never comes; saving and resuming work the same. Importing this
module imports neither torch nor accelerate.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path
from typing import Any, SupportsFloat

from hpc_train.integrations.metrics import scalars, started_context

__all__ = ["Checkpoints"]

_FOLDER = re.compile(r"step-([0-9]+)")


class Checkpoints:
    """``accelerator.save_state`` checkpoints in ``folder/step-N``, saved every ``every`` steps (0: only on a
    signal) and when hpc_train says stop."""

    def __init__(self, accelerator: Any, folder: str | os.PathLike[str], every: int = 0, keep: int = 2) -> None:
        self.accelerator, self.folder, self.every, self.keep = accelerator, Path(folder), every, max(1, keep)
        self.ctx = started_context()
        self.saved_step: int | None = None
        self.stopped_at: int | None = None

    def steps(self) -> list[int]:
        """The steps of the complete checkpoints, oldest first."""
        if not self.folder.is_dir():
            return []
        found = [int(m[1]) for p in self.folder.iterdir() if p.is_dir() and (m := _FOLDER.fullmatch(p.name))]
        return sorted(found)

    def resume(self) -> int:
        """Load the newest complete checkpoint into the accelerator's objects; its step (0 when none)."""
        steps = self.steps()
        if not steps:
            return 0
        self.accelerator.load_state(str(self.folder / f"step-{steps[-1]}"))
        if self.ctx is not None:
            self.ctx.step_done(steps[-1])
        self.saved_step = steps[-1]
        return steps[-1]

    def save(self, step: int) -> Path:
        """Collective: every rank writes its part of ``step-STEP``; the main process makes it complete."""
        final = self.folder / f"step-{step}"
        partial = self.folder / f".step-{step}.partial"
        if self.accelerator.is_main_process:
            self.folder.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(partial, ignore_errors=True)
        self.accelerator.wait_for_everyone()
        self.accelerator.save_state(output_dir=str(partial))
        self.accelerator.wait_for_everyone()
        if self.accelerator.is_main_process:
            shutil.rmtree(final, ignore_errors=True)
            os.replace(partial, final)
            for old in self.steps()[:-self.keep]:
                shutil.rmtree(self.folder / f"step-{old}", ignore_errors=True)
        self.accelerator.wait_for_everyone()
        self.saved_step = step
        return final

    def step_end(self, step: int, **values: SupportsFloat) -> bool:
        """After optimizer step ``step``: log ``values``, save when due or when hpc_train says stop; True (on
        every rank at once) when the loop must end now."""
        if self.ctx is not None:
            self.ctx.log(step, **scalars(values))
        if self.every and step % self.every == 0:
            self.save(step)
        if self.ctx is None or not self.ctx.should_stop():
            return False
        if self.saved_step != step:
            self.save(step)
        self.stopped_at = step
        return True
