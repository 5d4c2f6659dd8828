"""The model families the trainer knows, each behind one :class:`~hpc_train.rank.train.models.spec.ModelSpec`.

The built-in GPT (:mod:`hpc_train.rank.train.models.gpt`), whose shapes are the ``train.model`` presets, and a
user's model from its factory (:mod:`hpc_train.rank.train.models.user`). Importing this package imports no torch.
"""

from __future__ import annotations

from hpc_train.config.job import MODEL_PRESETS
from hpc_train.rank.train.models.gpt import GPT_SPEC
from hpc_train.rank.train.models.spec import ModelSpec, Param

__all__ = ["GPT_SPEC", "ModelSpec", "Param", "model_spec"]


def model_spec(model: str) -> ModelSpec:
    """The spec of ``train.model`` (validated on the login node): the GPT for a preset, else the user's factory
    (imported here, so call it where user code may run: on a rank)."""
    if model in MODEL_PRESETS or ":" not in model:  # a name is a preset: the GPT's spec refuses unknown ones
        return GPT_SPEC
    from hpc_train.rank.train.models.user import user_spec

    return user_spec(model)
