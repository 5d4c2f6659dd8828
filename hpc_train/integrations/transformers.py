"""The Hugging Face ``Trainer`` on hpc_train: ``Trainer(..., callbacks=[HpcTrainCallback()])`` and
``trainer.train(resume_from_checkpoint=get_last_checkpoint(output_dir))``.

After every optimizer step the callback tells hpc_train the Trainer's ``global_step`` and asks ``should_stop()``
(collective: every rank, at the same step). When a preemption or time-limit signal has come it sets
``control.should_save`` and ``control.should_training_stop``: the Trainer writes ``checkpoint-STEP`` itself, as
at any save (model, optimizer, scheduler, RNG states, its data position), and ``train()`` returns after that
step on every rank, so ``get_last_checkpoint`` resumes exactly there: no step lost, none trained twice. What the
Trainer logs (``loss``, ``learning_rate``, ``grad_norm``, ...) goes to hpc_train's metrics, one record a step.

Outside hpc_train (``torchrun train.py``) the callback does nothing. Importing this module imports neither torch
nor transformers; the class is built when it is first named.
"""

from __future__ import annotations

from typing import Any

__all__ = ["HpcTrainCallback"]  # noqa: F822 - built on first use, by the module's __getattr__

_BUILT: list[type] = []


def _build() -> type:
    from transformers import TrainerCallback

    from hpc_train.integrations.metrics import scalars, started_context

    class HpcTrainCallback(TrainerCallback):  # type: ignore[misc]
        """Asks ``should_stop()`` after each optimizer step and has the Trainer save and stop on a signal;
        reports the step and the Trainer's logs."""

        def __init__(self) -> None:
            self.stopped_at: int | None = None
            self._ctx: Any = None
            self._pending: tuple[int, dict[str, float]] | None = None

        def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self._ctx = started_context()

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if self._ctx is None:
                return
            step = int(state.global_step)
            self._ctx.step_done(step)
            if self._ctx.should_stop():
                control.should_save = True
                control.should_training_stop = True
                self.stopped_at = step

        def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None,
                   **kwargs: Any) -> None:
            """The Trainer logs a step after its ``on_step_end`` (and once more at the end, with the run's
            totals): gather them into one record for the step."""
            if self._ctx is None or not logs:
                return
            step = int(state.global_step)
            if self._pending is not None and self._pending[0] != step:
                self._flush()
            values = scalars(logs)
            if self._pending is not None:
                values = {**self._pending[1], **values}
            self._pending = (step, values)

        def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self._flush()

        def _flush(self) -> None:
            if self._pending is not None and self._ctx is not None:
                step, values = self._pending
                self._ctx.log(step, **values)
            self._pending = None

    return HpcTrainCallback


def __getattr__(name: str) -> Any:
    if name != "HpcTrainCallback":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if not _BUILT:
        _BUILT.append(_build())
    return _BUILT[0]
