"""The model families the trainer knows, each behind one :class:`~hpc_train.train.models.spec.ModelSpec`.

Today there is one, the built-in GPT (:mod:`hpc_train.train.models.gpt`), and every ``train.model`` preset is a
shape of it. Importing this package imports no torch.
"""

from __future__ import annotations

from hpc_train.train.models.gpt import GPT_SPEC
from hpc_train.train.models.spec import ModelSpec, Param

__all__ = ["GPT_SPEC", "ModelSpec", "Param", "model_spec"]


def model_spec(preset: str) -> ModelSpec:
    """The model family of a ``train.model`` preset (validated on the login node): the built-in GPT."""
    del preset  # every preset of config.job.MODEL_PRESETS is a GPT shape
    return GPT_SPEC
