"""``ckpt export``: one consolidated fp32 state dict of the model from a DeepSpeed checkpoint folder.

Why a separate module: it is the only ``ckpt`` command that loads checkpoint files, so it is the only one that
imports torch and DeepSpeed (lazily, inside the functions), and it loads nothing before the caller has checked
every file against the manifest with sha256: DeepSpeed's files are pickles that run code when loaded.

What comes out is a plain ``dict`` of name -> contiguous fp32 CPU tensor, named as in
``GPT.named_parameters()``, saved with ``torch.save`` so ``torch.load(FILE, weights_only=True)`` reads it:

* ZeRO 1-3 without a pipeline: DeepSpeed's ``get_fp32_state_dict_from_zero_checkpoint`` merges the fp32 master
  partitions of every data-parallel rank (whatever the training dtype);
* ZeRO-0 or a pipeline, trained in fp32: the module weights DeepSpeed saved are the fp32 weights themselves
  (``mp_rank_00_model_states.pt``, or one ``layer_XX-...-model_states.pt`` per pipeline layer, renamed with
  the model spec's ``parameter_name``, :func:`~hpc_train.train.pipeline.gpt_parameter_name` for the GPT).

Tensor-parallel checkpoints (tensor > 1), and ZeRO-0 or pipeline checkpoints trained in bf16/fp16 (their fp32
master copy lives in optimizer files export does not merge), are refused with a ConfigError that says so.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import pickle
import re
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpc_train.ckpt.manager import fsync_path
from hpc_train.ckpt.manifest import Manifest
from hpc_train.errors import ConfigError
from hpc_train.run.paths import MODEL_FILE

__all__ = [
    "ExportResult",
    "check_out_folder",
    "check_out_path",
    "check_supported",
    "export_checkpoint",
    "export_hf",
]

STATE_TAG = "state"  # DeepSpeed's tag folder inside a step folder (hpc_train.train.checkpointing.TAG)
_LAYER_FILE = re.compile(r"^layer_([0-9]{2,})-(?:model_00-)?model_states\.pt$")


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


def check_out_path(out: Path, force: bool) -> None:
    """Refuse an output path that cannot be written as asked, before anything is loaded."""
    parent = out.parent if str(out.parent) else Path(".")
    if not parent.is_dir():
        raise ConfigError("--out", f"the folder {parent} does not exist", f"create it (mkdir -p {parent}) or pick "
                          "a path in an existing folder")
    if out.is_dir():
        raise ConfigError("--out", f"{out} is a folder", "give a file name, like model.pt")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError("--out", f"the folder {parent} is not writable for you", "pick a folder you can write")
    if (out.exists() or out.is_symlink()) and not force:
        raise ConfigError("--out", f"{out} already exists", "pick another name, or pass --force to replace it")


def _layout_text(manifest: Manifest) -> str:
    layout = manifest.layout
    return (f"tensor {layout['tensor']} x pipeline {layout['pipeline']} x data {layout['data']} x context "
            f"{layout['context']}, ZeRO-{manifest.zero_stage}, {manifest.dtype}")


def check_supported(folder: Path, manifest: Manifest) -> None:
    """Refuse, naming the layout and the way out, a checkpoint this exporter cannot consolidate exactly."""
    layout, where = manifest.layout, str(folder)
    if layout["tensor"] > 1:
        raise ConfigError(where, f"its layout is {_layout_text(manifest)}; export supports tensor = 1 (merging "
                          "tensor-parallel shards is not built)",
                          "export a checkpoint of a run trained with parallel.tensor = 1, or gather the shards "
                          "in a job of the same layout (DeepSpeed load_checkpoint)")
    if (layout["pipeline"] > 1 or manifest.zero_stage == 0) and manifest.dtype != "fp32":
        raise ConfigError(where, f"its layout is {_layout_text(manifest)}; without ZeRO 1-3 on a single pipeline "
                          "stage the fp32 master weights sit in optimizer files export does not merge",
                          'export runs trained with train.precision = "fp32" there, or use zero.stage >= 1 '
                          "with parallel.pipeline = 1")


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """DeepSpeed prints progress to stdout and stderr while consolidating; keep the command's output ours."""
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        yield


def _zero_state(state_dir: Path) -> dict[str, Any]:
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    return dict(get_fp32_state_dict_from_zero_checkpoint(str(state_dir.parent), tag=state_dir.name))


def _module_state(state_dir: Path) -> dict[str, Any]:
    import torch

    saved = torch.load(state_dir / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=True)
    return dict(saved["module"])


def _trained_model(folder: Path) -> str:
    """``train.model`` of the run that saved ``folder``, from its ``model.json`` ("tiny" when a run from before
    model.json has none: then it trained the built-in GPT)."""
    try:
        card = json.loads((folder.parent.parent / MODEL_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return "tiny"
    return str(card.get("model", "tiny")) if isinstance(card, dict) else "tiny"


def _pipeline_state(state_dir: Path) -> dict[str, Any]:
    """Every layer file of the tensor rank 0, renamed from ``"<layer>.<name>"`` by the model spec: to GPT's
    names for the built-in GPT, kept as they are (``nn.Sequential(*layers)``'s names) for a user's layers."""
    import torch

    from hpc_train.config.job import MODEL_PRESETS

    files = {int(m.group(1)): state_dir / name for name in os.listdir(state_dir) if (m := _LAYER_FILE.match(name))}
    gpt = _trained_model(state_dir.parent) in MODEL_PRESETS
    if not files or sorted(files) != list(range(len(files))) or (gpt and len(files) < 3):
        raise ValueError(f"expected layer_00 ... layer_NN model-state files{' (embedding, blocks, head)' * gpt}, "
                         f"found layers {sorted(files)}")
    rename = _gpt_name(len(files) - 2) if gpt else (lambda name: name)
    state: dict[str, Any] = {}
    for index, path in sorted(files.items()):
        for name, tensor in torch.load(path, map_location="cpu", weights_only=True).items():
            state[rename(f"{index}.{name}")] = tensor
    return state


def _gpt_name(blocks: int) -> Any:
    from hpc_train.train.models import GPT_SPEC

    return lambda name: GPT_SPEC.parameter_name(name, blocks)


def _load_fp32(folder: Path, manifest: Manifest) -> dict[str, Any]:
    """The consolidated state as fresh contiguous tensors, floating point ones in fp32, integer buffers (a batch
    norm's count) as they are, so that ``load_state_dict(strict=True)`` finds every key (no views into
    DeepSpeed's flat buffers, which torch.save would otherwise write whole)."""
    import torch

    state_dir = folder / STATE_TAG
    if manifest.layout["pipeline"] > 1:
        loader = _pipeline_state
    else:
        loader = _zero_state if manifest.zero_stage >= 1 else _module_state
    try:
        with _quiet():
            state = loader(state_dir)
    except (OSError, ValueError, KeyError, RuntimeError, TypeError, pickle.UnpicklingError) as error:
        raise ConfigError(str(folder), f"verifies, but DeepSpeed's files cannot be consolidated "
                          f"({type(error).__name__}: {error})", "export another step") from None
    return {name: (tensor.detach().to(dtype=torch.float32) if tensor.is_floating_point() else tensor.detach())
            .to(device="cpu").contiguous().clone() for name, tensor in state.items() if torch.is_tensor(tensor)}


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


def _write(state: dict[str, Any], out: Path, force: bool) -> None:
    """torch.save into a private (0600) temporary file beside ``out``, fsync, then rename: never a half file."""
    import torch

    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    descriptor = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        with open(descriptor, "wb") as handle:
            torch.save(state, handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(tmp, 0o600)
        _publish(tmp, out, force)
    finally:
        tmp.unlink(missing_ok=True)
    fsync_path(out.parent if str(out.parent) else Path("."))


def export_checkpoint(folder: Path, manifest: Manifest, out: Path, force: bool = False) -> ExportResult:
    """Consolidate the verified step folder ``folder`` into ``out``. The caller has verified it with sha256."""
    check_out_path(out, force)
    check_supported(folder, manifest)
    state = _load_fp32(folder, manifest)
    if not state:
        raise ConfigError(str(folder), "holds no floating-point model weights", "export another step")
    _write(state, out, force)
    return ExportResult(out=out, source=folder, step=manifest.step, tensors=len(state),
                        parameters=sum(t.numel() for t in state.values()),
                        bytes=sum(t.numel() * t.element_size() for t in state.values()),
                        file_bytes=out.stat().st_size)


def _hf_config(folder: Path) -> tuple[dict[str, Any], list[str]]:
    """The Hugging Face config and the tied weights the run's ``model.json`` recorded for ``folder``'s run."""
    card_path = folder.parent.parent / MODEL_FILE
    try:
        card = json.loads(card_path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        card = {}
    config = card.get("hf_config") if isinstance(card, dict) else None
    if not isinstance(config, dict):
        raise ConfigError(str(folder), f"its run was not trained from a Hugging Face model ({card_path} records no "
                          "config)", "export it with --format pt, the state dict under the module's own names")
    tied = card.get("tied", [])
    return config, [name for name in tied if isinstance(name, str)]


def check_out_folder(out: Path, force: bool) -> None:
    """Refuse an output folder (``--format hf``) that cannot be written as asked, before anything is loaded."""
    parent = out.parent if str(out.parent) else Path(".")
    if not parent.is_dir():
        raise ConfigError("--out", f"the folder {parent} does not exist", f"create it (mkdir -p {parent})")
    if out.is_symlink() or (out.exists() and not out.is_dir()):
        raise ConfigError("--out", f"{out} exists and is not a folder", "give a new folder name, like model-hf")
    if out.exists() and not force:
        raise ConfigError("--out", f"{out} already exists", "pick another name, or pass --force to replace it")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError("--out", f"the folder {parent} is not writable for you", "pick a folder you can write")


def export_hf(folder: Path, manifest: Manifest, out: Path, force: bool = False) -> ExportResult:
    """``out`` as ``save_pretrained`` writes it: ``config.json`` and ``model.safetensors`` (tied weights stored
    once), so ``AutoModelForCausalLM.from_pretrained(out)`` loads it. The caller has verified ``folder``."""
    from safetensors.torch import save_file

    check_out_folder(out, force)
    check_supported(folder, manifest)
    config, tied = _hf_config(folder)
    state = {name: tensor for name, tensor in _load_fp32(folder, manifest).items() if name not in tied}
    if not state:
        raise ConfigError(str(folder), "holds no floating-point model weights", "export another step")
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
    return ExportResult(out=out, source=folder, step=manifest.step, tensors=len(state),
                        parameters=sum(t.numel() for t in state.values()),
                        bytes=sum(t.numel() * t.element_size() for t in state.values()),
                        file_bytes=sum(path.stat().st_size for path in out.iterdir()))
