"""``ckpt export``: one consolidated state dict of the model from a DeepSpeed checkpoint folder.

Why a separate module: it is the only ``ckpt`` command that loads checkpoint files, so it is the only one that
imports torch and DeepSpeed (lazily, inside the functions), and it loads nothing before the caller has checked
every file against the manifest with sha256: DeepSpeed's files are pickles that run code when loaded.

What is merged: name -> contiguous CPU tensor, named as the module names its parameters (``GPT.named_parameters()``
for the built-in GPT), floating point in fp32 (``--dtype bf16``: cast to bf16 at the end), integer buffers as
they are:

* ZeRO 1-3 without a pipeline: DeepSpeed's ``get_fp32_state_dict_from_zero_checkpoint`` merges the fp32 master
  partitions of every data-parallel rank (whatever the training dtype);
* ZeRO-0 or a pipeline, trained in fp32: the module weights DeepSpeed saved are the fp32 weights themselves
  (``mp_rank_00_model_states.pt``, or one ``layer_XX-model_00-model_states.pt`` per pipeline layer, renamed
  with the model spec's ``parameter_name``, :func:`~hpc_train.rank.train.pipeline.gpt_parameter_name` for the GPT).
* tensor > 1: the above once per tensor rank (DeepSpeed's consolidation reads one ``mp_rank_NN`` per folder, so
  each rank's files are linked into a private temporary folder of their own), then every parameter that the
  run's ``model.json`` records as tensor-parallel (:mod:`hpc_train.rank.train.model_card`, written by rank 0 before
  the first step) is concatenated along its split dim and checked against its recorded full shape; every
  other parameter is whole on each rank and taken from rank 0. The result is what a tensor = 1 run would export.

ZeRO-0 or pipeline checkpoints trained in bf16/fp16 (their fp32 master copy lives in optimizer files export does
not merge), and tensor-parallel checkpoints whose run recorded no split dims, are refused with a ConfigError.

The formats: ``safetensors`` (recommended: no pickle, loadable anywhere, the description of the model inside
its metadata); ``pt``, a plain ``dict`` of tensors for ``torch.load(FILE, weights_only=True)`` and
``load_state_dict(strict=True)`` (the default, as before), with the description in a sidecar ``FILE.json``
beside it, so the file itself stays what ``load_state_dict`` takes; ``hf``, a ``save_pretrained`` folder. The
description (:mod:`hpc_train.checkpoint.exported`, which also reads it back) is what
:func:`hpc_train.rank.train.load_exported` needs to rebuild the built-in GPT. Every file is written in a private
temporary folder beside the output, fsynced and renamed into place: never a half file.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import pickle
import re
import shutil
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpc_train.checkpoint.dcp_state import DCP_DIR, dcp_model_state
from hpc_train.checkpoint.export_checks import check_engine, check_out_folder, check_out_path
from hpc_train.checkpoint.exported import (
    DTYPE_KEY,
    EXPORT_KEY,
    EXPORT_VERSION,
    GPT_CONFIG_KEY,
    MODEL_KEY,
    STEP_KEY,
    sidecar_path,
)
from hpc_train.checkpoint.manager import fsync_path
from hpc_train.checkpoint.manifest import Manifest, engine_text
from hpc_train.checkpoint.names import DEEPSPEED_TAG
from hpc_train.config.job import MODEL_PRESETS
from hpc_train.config.model_shapes import gpt_parameter_name
from hpc_train.errors import ConfigError
from hpc_train.run.files import MAX_RECORD_FILE, open_record
from hpc_train.run.paths import MODEL_FILE

__all__ = [
    "DTYPES",
    "FORMATS",
    "ExportResult",
    "check_engine",
    "check_out_folder",
    "check_out_path",
    "check_supported",
    "export_checkpoint",
    "export_hf",
    "merge_tensor_parallel",
    "rank_files",
]

FORMATS = ("safetensors", "pt", "hf")
DTYPES = ("fp32", "bf16")
_LAYER_FILE = re.compile(r"^layer_([0-9]{2,})-(?:model_([0-9]{2,})-)?model_states\.pt$")
_MP_FILE = re.compile(r"(?:^|_)mp_rank_([0-9]{2,})_(?:model|optim)_states\.pt$")
_TP_FIX = ("train it one more step with this hpc_train (submit it again with train.steps one higher: rank 0 "
           "rewrites model.json before its first step) and export that checkpoint")


@dataclass(frozen=True)
class ExportResult:
    """What was written: the file, the step folder it came from, and how much it holds."""

    out: Path
    source: Path
    step: int
    tensors: int
    parameters: int
    bytes: int
    file_bytes: int
    format: str = "pt"
    dtype: str = "fp32"


def _layout_text(manifest: Manifest) -> str:
    layout = manifest.layout
    return (f"tensor {layout['tensor']} x pipeline {layout['pipeline']} x data {layout['data']} x context "
            f"{layout['context']}, {engine_text(manifest.engine, manifest.zero_stage)}, {manifest.dtype}")


def _card(folder: Path) -> dict[str, Any]:
    """The run's ``model.json`` (``{}`` when a run from before it has none, or it cannot be read)."""
    try:
        with open_record(folder.parent.parent / MODEL_FILE) as handle:
            card = json.loads(handle.read(MAX_RECORD_FILE).decode("utf-8"))
    except (OSError, ValueError):
        return {}
    return card if isinstance(card, dict) else {}


def _tp_record(folder: Path, manifest: Manifest) -> dict[str, Any]:
    """The split dims and full shapes ``model.json`` recorded, checked; ConfigError when export cannot use them."""
    where = str(folder)
    record = _card(folder).get("tensor_parallel")
    dims = record.get("split_dims") if isinstance(record, dict) else None
    if isinstance(record, dict) and "error" in record:
        raise ConfigError(where, f"its layout is {_layout_text(manifest)}, and rank 0 could not record the split "
                          f"dims in its run's {MODEL_FILE} ({record['error']})", _TP_FIX)
    if not isinstance(dims, dict):
        raise ConfigError(where, f"its layout is {_layout_text(manifest)}, and its run's {MODEL_FILE} records no "
                          "tensor-parallel split dims (the run predates them), so the shards cannot be merged",
                          _TP_FIX)
    unknown = record.get("unknown") or []
    if unknown:
        raise ConfigError(where, f"its run's {MODEL_FILE} records {len(unknown)} tensor-parallel parameter(s) "
                          f"whose split dim is unknown ({', '.join(map(str, unknown[:3]))})",
                          "build them with hpc_train's ColumnParallelLinear, RowParallelLinear or "
                          "VocabParallelEmbedding, or set param.partition_dim, then train one more step")
    shapes = record.get("shapes") if isinstance(record.get("shapes"), dict) else {}
    return {"split_dims": dims, "shapes": shapes}


def check_supported(folder: Path, manifest: Manifest) -> None:
    """Refuse, naming the layout and the way out, a checkpoint this exporter cannot consolidate exactly."""
    check_engine(folder, manifest)
    layout, where = manifest.layout, str(folder)
    if manifest.engine == "deepspeed" and (layout["pipeline"] > 1 or manifest.zero_stage == 0) \
            and manifest.dtype != "fp32":
        raise ConfigError(where, f"its layout is {_layout_text(manifest)}; without ZeRO 1-3 on a single pipeline "
                          "stage the fp32 master weights sit in optimizer files export does not merge",
                          'export runs trained with train.precision = "fp32" there, or use zero.stage >= 1 '
                          "with parallel.pipeline = 1")
    if layout["tensor"] > 1:
        _tp_record(folder, manifest)


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """DeepSpeed prints progress to stdout and stderr while consolidating; keep the command's output ours."""
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        yield


def rank_files(state_dir: Path) -> dict[int, list[Path]]:
    """Each tensor rank's DeepSpeed files (``*mp_rank_NN_{model,optim}_states.pt``) by rank."""
    ranks: dict[int, list[Path]] = {}
    for name in sorted(os.listdir(state_dir)):
        if match := _MP_FILE.search(name):
            ranks.setdefault(int(match.group(1)), []).append(state_dir / name)
    return ranks


@contextlib.contextmanager
def _rank_view(files: list[Path]) -> Iterator[Path]:
    """A private temporary tag folder holding links to ``files`` only: one tensor rank's checkpoint, as DeepSpeed's
    consolidation reads it (it globs every ``*_optim_states.pt`` of the folder)."""
    with tempfile.TemporaryDirectory(prefix="hpc_train-export-") as tmp:  # mode 0700
        view = Path(tmp) / DEEPSPEED_TAG
        view.mkdir(mode=0o700)
        for path in files:
            os.symlink(path.resolve(), view / path.name)
        yield view


def _zero_state(state_dir: Path, rank: int | None) -> dict[str, Any]:
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    if rank is None:
        return dict(get_fp32_state_dict_from_zero_checkpoint(str(state_dir.parent), tag=state_dir.name))
    with _rank_view(rank_files(state_dir).get(rank, [])) as view:
        return dict(get_fp32_state_dict_from_zero_checkpoint(str(view.parent), tag=view.name))


def _module_state(state_dir: Path, rank: int | None) -> dict[str, Any]:
    import torch

    path = state_dir / f"mp_rank_{rank or 0:02d}_model_states.pt"
    return dict(torch.load(path, map_location="cpu", weights_only=True)["module"])


def _layer_files(state_dir: Path, rank: int | None) -> dict[int, Path]:
    files: dict[int, Path] = {}
    for name in os.listdir(state_dir):
        if (match := _LAYER_FILE.match(name)) and int(match.group(2) or 0) == (rank or 0):
            files[int(match.group(1))] = state_dir / name
    return files


def _pipeline_state(state_dir: Path, rank: int | None) -> dict[str, Any]:
    """Every layer file of one tensor rank, as ``"<layer>.<name>"`` (renamed after the merge)."""
    import torch

    files = _layer_files(state_dir, rank)
    gpt = _card(state_dir.parent).get("model", "tiny") in MODEL_PRESETS
    if not files or sorted(files) != list(range(len(files))) or (gpt and len(files) < 3):
        raise ValueError(f"expected layer_00 ... layer_NN model-state files{' (embedding, blocks, head)' * gpt}, "
                         f"found layers {sorted(files)}")
    state: dict[str, Any] = {}
    for index, path in sorted(files.items()):
        for name, tensor in torch.load(path, map_location="cpu", weights_only=True).items():
            state[f"{index}.{name}"] = tensor
    return state


def _renamed(state: dict[str, Any], folder: Path) -> dict[str, Any]:
    """A pipeline's ``"<layer>.<name>"`` renamed by the model spec: to GPT's names for the built-in GPT, kept as
    they are (``nn.Sequential(*layers)``'s names) for a user's layers."""
    if _card(folder).get("model", "tiny") not in MODEL_PRESETS:
        return state
    blocks = len(_layer_files(folder / DEEPSPEED_TAG, 0)) - 2
    return {gpt_parameter_name(name, blocks): tensor for name, tensor in state.items()}


def merge_tensor_parallel(states: list[dict[str, Any]], split_dims: dict[str, Any], shapes: dict[str, Any],
                          where: str) -> dict[str, Any]:
    """One state from the states of every tensor rank: each parameter of ``split_dims`` concatenated along its
    dim (and checked against ``shapes``, its full shape, when recorded), every other one taken from rank 0 (its
    shape checked the same on every rank). ConfigError naming ``where`` for shards that do not fit."""
    import torch

    fix = "export a checkpoint of the run this model.json describes, or " + _TP_FIX
    names = list(states[0])
    for rank, state in enumerate(states[1:], start=1):
        if set(state) != set(names):
            odd = sorted(set(state) ^ set(names))[:3]
            raise ConfigError(where, f"tensor ranks 0 and {rank} hold different tensors ({', '.join(odd)})", fix)
    missing = sorted(set(split_dims) - set(names))
    if missing:
        raise ConfigError(where, f"model.json records {', '.join(missing[:3])} as tensor-parallel, the checkpoint "
                          "holds no such tensor", fix)
    merged: dict[str, Any] = {}
    for name in names:
        shards = [state[name] for state in states]
        dim = split_dims.get(name)
        try:
            if dim is not None:
                merged[name] = torch.cat(shards, dim=int(dim))
            elif any(shard.shape != shards[0].shape for shard in shards):
                raise ValueError("its shape differs between tensor ranks")
            else:
                merged[name] = shards[0]
        except (RuntimeError, ValueError, IndexError, TypeError) as error:
            raise ConfigError(where, f"the shards of {name} ({[tuple(s.shape) for s in shards]}) do not merge "
                              f"along dim {dim}: {error}", fix) from None
        expected = shapes.get(name)
        if expected is not None and list(merged[name].shape) != list(expected):
            raise ConfigError(where, f"the shards of {name} concatenate to {list(merged[name].shape)}, model.json "
                              f"records {list(expected)}", fix)
    return merged


def _loader(manifest: Manifest) -> Callable[[Path, int | None], dict[str, Any]]:
    if manifest.layout["pipeline"] > 1:
        return _pipeline_state
    return _zero_state if manifest.zero_stage >= 1 else _module_state


def _load_fp32(folder: Path, manifest: Manifest) -> dict[str, Any]:
    """The consolidated state as fresh contiguous tensors, floating point ones in fp32, integer buffers (a batch
    norm's count) as they are, so that ``load_state_dict(strict=True)`` finds every key (no views into
    DeepSpeed's flat buffers, which torch.save would otherwise write whole)."""
    state_dir, tensor, loader = folder / DEEPSPEED_TAG, manifest.layout["tensor"], _loader(manifest)
    try:
        with _quiet():
            if (folder / DCP_DIR).is_dir():  # an FSDP2 run: DCP's shards, whole again without a process group
                state = dcp_model_state(folder / DCP_DIR)
            elif tensor == 1:
                state = loader(state_dir, None)
            else:
                record = _tp_record(folder, manifest)
                found = sorted(rank_files(state_dir))
                if manifest.layout["pipeline"] == 1 and found != list(range(tensor)):
                    raise ValueError(f"expected the files of tensor ranks 0 .. {tensor - 1}, found ranks {found}")
                states = [_fp32(loader(state_dir, rank)) for rank in range(tensor)]
                state = merge_tensor_parallel(states, record["split_dims"], record["shapes"], str(folder))
            if manifest.layout["pipeline"] > 1:
                state = _renamed(state, folder)
    except (OSError, ValueError, KeyError, AttributeError, RuntimeError, TypeError, pickle.UnpicklingError) as error:
        if isinstance(error, ConfigError):
            raise
        raise ConfigError(str(folder), f"verifies, but DeepSpeed's files cannot be consolidated "
                          f"({type(error).__name__}: {error})", "export another step") from None
    return {name: tensor.contiguous().clone() for name, tensor in _fp32(state).items()}


def _fp32(state: dict[str, Any]) -> dict[str, Any]:
    import torch

    return {name: (tensor.detach().to(dtype=torch.float32) if tensor.is_floating_point() else tensor.detach())
            .to(device="cpu") for name, tensor in state.items() if torch.is_tensor(tensor)}


def _cast(state: dict[str, Any], dtype: str) -> dict[str, Any]:
    """Floating tensors in ``dtype``, integer buffers kept."""
    import torch

    if dtype == "fp32":
        return state
    return {name: tensor.to(torch.bfloat16) if tensor.is_floating_point() else tensor for name, tensor in state.items()}


def _gpt_config(card: dict[str, Any], state: dict[str, Any]) -> dict[str, int] | None:
    """The built-in GPT's shape: from ``model.json``, or for a run from before it recorded one, its preset with
    the vocabulary and length of the embeddings."""
    model = card.get("model", "tiny")
    if model not in MODEL_PRESETS:
        return None
    if isinstance(card.get("gpt_config"), dict):
        return dict(card["gpt_config"])
    if "wte.weight" not in state or "wpe.weight" not in state:
        return None
    preset = MODEL_PRESETS[model]
    return {"vocab_size": int(state["wte.weight"].shape[0]), "seq_len": int(state["wpe.weight"].shape[0]),
            "layers": preset["layers"], "heads": preset["heads"], "hidden": preset["hidden"]}


def _description(folder: Path, manifest: Manifest, state: dict[str, Any], dtype: str) -> dict[str, str]:
    """What :func:`hpc_train.rank.train.load_exported` reads back (safetensors metadata is ``str -> str``)."""
    card = _card(folder)
    description = {"format": "pt", EXPORT_KEY: EXPORT_VERSION, MODEL_KEY: str(card.get("model", "tiny")),
                   DTYPE_KEY: dtype, STEP_KEY: str(manifest.step)}
    if (gpt := _gpt_config(card, state)) is not None:
        description[GPT_CONFIG_KEY] = json.dumps(gpt, sort_keys=True)
    return description


def _publish(tmp: Path, out: Path, force: bool) -> None:
    """Move the finished file into place; without ``force`` a hard link refuses, atomically, to replace a file
    that appeared since the first check."""
    if force:
        os.replace(tmp, out)
        return
    try:
        os.link(tmp, out)
    except FileExistsError:
        raise ConfigError("--out", f"{out} already exists", "pick another name, or pass --force to replace it") \
            from None
    except OSError:  # a file system without hard links
        if out.exists() or out.is_symlink():
            raise ConfigError("--out", f"{out} already exists", "pick another name, or pass --force") from None
        os.replace(tmp, out)
        return
    tmp.unlink()


def _private_file(path: Path) -> Any:
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    return open(descriptor, "wb")


def _write(state: dict[str, Any], out: Path, force: bool, fmt: str, description: dict[str, str]) -> None:
    """The file (and for pt its sidecar) written in a private (0700) temporary folder beside ``out``, each file
    0600 and fsynced, then renamed into place, the file first: never a half file."""
    import torch
    from safetensors.torch import save_file

    parent = out.parent if str(out.parent) else Path(".")
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=parent))
    try:
        written, side = tmp / "export", tmp / "description.json"
        if fmt == "safetensors":
            save_file(state, str(written), metadata=description)  # in the 0700 folder: no one else can see it
            os.chmod(written, 0o600)
        else:
            with _private_file(written) as handle:
                torch.save(state, handle)
            with _private_file(side) as handle:
                handle.write((json.dumps(description, indent=2, sort_keys=True) + "\n").encode("utf-8"))
            fsync_path(side)
        fsync_path(written)
        _publish(written, out, force)
        if fmt == "pt":
            os.replace(side, sidecar_path(out))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    fsync_path(parent)


def _result(out: Path, folder: Path, manifest: Manifest, state: dict[str, Any], fmt: str, dtype: str,
            file_bytes: int) -> ExportResult:
    return ExportResult(out=out, source=folder, step=manifest.step, tensors=len(state),
                        parameters=sum(t.numel() for t in state.values()),
                        bytes=sum(t.numel() * t.element_size() for t in state.values()), file_bytes=file_bytes,
                        format=fmt, dtype=dtype)


def export_checkpoint(folder: Path, manifest: Manifest, out: Path, force: bool = False, fmt: str = "pt",
                      dtype: str = "fp32") -> ExportResult:
    """Consolidate the verified step folder ``folder`` into ``out`` (``fmt`` safetensors or pt, floating tensors
    in ``dtype``). The caller has verified it with sha256."""
    if fmt not in ("safetensors", "pt") or dtype not in DTYPES:
        raise ConfigError("--format/--dtype", f"{fmt}/{dtype} is not a file format and dtype export writes",
                          "use --format safetensors or pt, --dtype fp32 or bf16")
    check_out_path(out, force, sidecar=fmt == "pt")
    check_supported(folder, manifest)
    state = _load_fp32(folder, manifest)
    if not state:
        raise ConfigError(str(folder), "holds no floating-point model weights", "export another step")
    description = _description(folder, manifest, state, dtype)
    state = _cast(state, dtype)
    _write(state, out, force, fmt, description)
    return _result(out, folder, manifest, state, fmt, dtype, out.stat().st_size)


def _hf_config(folder: Path) -> tuple[dict[str, Any], list[str]]:
    """The Hugging Face config and the tied weights the run's ``model.json`` recorded for ``folder``'s run."""
    card = _card(folder)
    config = card.get("hf_config")
    if not isinstance(config, dict):
        raise ConfigError(str(folder), f"its run was not trained from a Hugging Face model "
                          f"({folder.parent.parent / MODEL_FILE} records no config)",
                          "export it with --format safetensors or pt, under the module's own names")
    tied = card.get("tied", [])
    return config, [name for name in tied if isinstance(name, str)]


def export_hf(folder: Path, manifest: Manifest, out: Path, force: bool = False, dtype: str = "fp32") -> ExportResult:
    """``out`` as ``save_pretrained`` writes it: ``config.json`` and ``model.safetensors`` (tied weights stored
    once), so ``AutoModelForCausalLM.from_pretrained(out)`` loads it. The caller has verified ``folder``."""
    from safetensors.torch import save_file

    check_out_folder(out, force)
    check_supported(folder, manifest)
    config, tied = _hf_config(folder)
    state = {name: tensor for name, tensor in _load_fp32(folder, manifest).items() if name not in tied}
    if not state:
        raise ConfigError(str(folder), "holds no floating-point model weights", "export another step")
    state = _cast(state, dtype)
    if dtype == "bf16":
        config = {**config, "torch_dtype": "bfloat16", **({"dtype": "bfloat16"} if "dtype" in config else {})}
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    os.mkdir(tmp, 0o700)
    try:
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        descriptor = os.open(tmp / "config.json", os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with open(descriptor, "w", encoding="utf-8") as handle:
            handle.write(json.dumps(config, indent=2, sort_keys=True) + "\n")
        for name in ("model.safetensors", "config.json"):
            fsync_path(tmp / name)
        if out.exists():
            shutil.rmtree(out)
        os.rename(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    fsync_path(out.parent if str(out.parent) else Path("."))
    return _result(out, folder, manifest, state, "hf", dtype, sum(path.stat().st_size for path in out.iterdir()))
