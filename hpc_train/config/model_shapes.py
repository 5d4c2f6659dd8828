"""The shapes a plan counts, in pure Python: a parameter tensor as one rank holds it, and the built-in GPT's
parameters per tensor-parallel rank of each pipeline stage. The login node's memory plan reads them
(:mod:`hpc_train.config.memory`), and the GPT's model spec on the ranks hands out the same function
(:mod:`hpc_train.rank.train.models.gpt`), so the two cannot drift."""

from __future__ import annotations

from typing import NamedTuple

from hpc_train.config.job import MODEL_PRESETS

__all__ = ["Param", "gpt_parameter_name", "gpt_stage_parameters", "require_positive"]


def require_positive(**values: int) -> None:
    """Sizes of a memory or parameter plan must be whole numbers >= 1; raise ValueError naming the first that is
    not (the login-node memory plan shows it as one line)."""
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} = {value!r}: must be a whole number >= 1")


class Param(NamedTuple):
    """One parameter tensor as one rank holds it: module-path name, elements, and whether it is a matrix (weight
    decay group of ``build_engine``, which DeepSpeed flattens first)."""

    name: str
    numel: int
    matrix: bool


def gpt_stage_parameters(preset: str, vocab_size: int, seq_len: int, tensor: int = 1,
                     pipeline: int = 1) -> list[list[Param]]:
    """The parameters one tensor-parallel rank of each pipeline stage holds, in ``model.parameters()`` order.

    Mirrors :class:`hpc_train.rank.train.model.GPT` without importing torch; the tests check it against the real
    model.
    """
    if preset not in MODEL_PRESETS:
        raise ValueError(f"model preset {preset!r} is unknown; use one of {', '.join(MODEL_PRESETS)}")
    require_positive(vocab_size=vocab_size, seq_len=seq_len, tensor=tensor, pipeline=pipeline)
    shape = MODEL_PRESETS[preset]
    layers, heads, h = shape["layers"], shape["heads"], shape["hidden"]
    if heads % tensor:
        raise ValueError(f"tensor = {tensor} does not divide the {heads} attention heads of {preset}; "
                         "use a tensor size that divides them")
    if vocab_size % tensor:
        raise ValueError(f"vocab_size = {vocab_size} is not divisible by tensor = {tensor}; pad the vocabulary to "
                         f"a multiple of {tensor} (e.g. {-(-vocab_size // tensor) * tensor})")
    if pipeline > layers:
        raise ValueError(f"pipeline = {pipeline} stages for the {layers} layers of {preset}; use at most {layers}")
    t = tensor

    def block(i: int) -> list[Param]:
        p = f"blocks.{i}."
        return [Param(p + "ln1.weight", h, False), Param(p + "ln1.bias", h, False),
                Param(p + "attn.qkv.weight", 3 * h * h // t, True), Param(p + "attn.qkv.bias", 3 * h // t, False),
                Param(p + "attn.proj.weight", h * h // t, True), Param(p + "attn.proj.bias", h, False),
                Param(p + "ln2.weight", h, False), Param(p + "ln2.bias", h, False),
                Param(p + "mlp.fc.weight", 4 * h * h // t, True), Param(p + "mlp.fc.bias", 4 * h // t, False),
                Param(p + "mlp.proj.weight", 4 * h * h // t, True), Param(p + "mlp.proj.bias", h, False)]

    counts = [layers // pipeline + (1 if i < layers % pipeline else 0) for i in range(pipeline)]
    stages: list[list[Param]] = []
    first = 0
    for index, count in enumerate(counts):
        params: list[Param] = []
        if index == 0:
            params += [Param("wte.weight", vocab_size // t * h, True), Param("wpe.weight", seq_len * h, True)]
        for i in range(first, first + count):
            params += block(i)
        if index == pipeline - 1:
            params += [Param("ln_f.weight", h, False), Param("ln_f.bias", h, False),
                       Param("head.weight", vocab_size // t * h, True)]
        stages.append(params)
        first += count
    return stages


def gpt_parameter_name(name: str, layers: int) -> str:
    """The name in ``GPT.named_parameters()`` of a pipeline parameter (``"1.attn.qkv.weight"`` ->
    ``"blocks.0.attn.qkv.weight"``), for comparing weights and converting checkpoints."""
    index, _, rest = name.partition(".")
    if not (index.isascii() and index.isdigit()) or not rest or not 0 <= int(index) <= layers + 1:
        raise ValueError(f"{name!r} is not a parameter of a {layers}-block pipeline GPT")
    if 1 <= int(index) <= layers:
        return f"blocks.{int(index) - 1}.{rest}"
    return rest
