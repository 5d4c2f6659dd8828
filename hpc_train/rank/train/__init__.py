"""The built-in trainer, its engines, models and data: code that runs on the ranks.

:func:`load_exported` rebuilds the built-in GPT from a ``ckpt export`` file (it imports torch when called, so
``import hpc_train.rank.train`` stays light)."""

from hpc_train.rank.train.exported import load_exported

__all__ = ["load_exported"]
