"""hpc_train inside the training libraries people already use: a few lines in their own script.

Each module here is importable without torch or the library (a login node, a linter, the docs): the library's
classes are built on first use, from whichever package the script imported (``lightning.pytorch`` or
``pytorch_lightning``; ``transformers``; ``accelerate``). What each gives a script run as ``job.program``:

- the stop after a preemption or time-limit signal at the step it arrived, on every rank together, saved through
  the library's own checkpointing so that the library's own resume continues exactly (no step lost or repeated);
- the library's step and what it logs in hpc_train's metrics (``metrics.jsonl``, TensorBoard, ``status``) and in
  the stop line and ``attempts.jsonl``.

:mod:`~hpc_train.integrations.lightning` (a ``Callback``), :mod:`~hpc_train.integrations.transformers` (a
``TrainerCallback``), :mod:`~hpc_train.integrations.accelerate` (checkpoints around ``save_state`` /
``load_state``). ``docs/your-own-code.md`` shows each.
"""
