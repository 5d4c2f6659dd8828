"""``python -m hpc_train ckpt ls|verify|export RUN_OR_CHECKPOINT``: look at a run's checkpoints from a login node.

``ls`` and ``verify`` read manifests and file sizes (and hashes with ``--sha256``) only, so they import neither
torch nor DeepSpeed and answer at once; ``export`` loads one checkpoint (after checking every file's sha256)
and imports them lazily (:mod:`hpc_train.checkpoint.export`). The checkpoint "resume would use" is chosen as
:meth:`CheckpointManager.latest_verified` chooses it: the one ``latest`` names, else the newest older one that
verifies; a folder newer than ``latest`` (a crash between rename and ``latest``) is never picked.

Exit status: 0 done; 1 ``verify`` found no checkpoint resume could use; 2 bad input (nothing written).
"""

from __future__ import annotations

import argparse
import os
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from hpc_train.checkpoint.manager import LATEST_NAME, CheckpointInfo, CheckpointManager, VerifyLevel, inspect_checkpoint
from hpc_train.checkpoint.manifest import engine_text
from hpc_train.common.terminal import json_text, plain, print_json, shown
from hpc_train.errors import ConfigError
from hpc_train.run.outputs import check_output
from hpc_train.run.paths import CHECKPOINTS_DIR, PLAN_FILE

__all__ = ["Listing", "Target", "add_parser", "collect", "resolve_target"]

_STEP = re.compile(r"^step-[0-9]{8,}$")
_WHAT = "give a run folder (runs/NAME), its checkpoints/ folder or one step-NNNNNNNN folder"


@dataclass(frozen=True)
class Target:
    """Where the checkpoints are (``root``, a ``checkpoints/`` folder) and, when one was named, which one."""

    root: Path
    only: Path | None = None


@dataclass(frozen=True)
class Listing:
    """The checkpoints of a target, oldest first, with the one ``latest`` names and the one resume would use."""

    root: Path
    level: VerifyLevel
    infos: list[CheckpointInfo]
    latest: CheckpointInfo | None
    resume: CheckpointInfo | None
    size_ok: frozenset[Path] = frozenset()  # the folders that pass the size check, whatever ``level`` says


def resolve_target(path: Path) -> Target:
    """A run folder, its ``checkpoints/`` folder or one step folder; anything else is a ConfigError."""
    if path.name in ("", ".", ".."):  # "." inside a step folder: its name tells what it is
        path = Path(os.path.normpath(path.absolute()))
    if not path.exists():
        raise ConfigError(str(path), "does not exist", _WHAT)
    if not path.is_dir():
        raise ConfigError(str(path), "is a file, not a folder", _WHAT)
    if _STEP.match(path.name):
        return Target(root=path.parent, only=path)
    if path.name.startswith(".tmp-step-"):
        raise ConfigError(str(path), "is the temporary folder of an unfinished (or crashed) save, never resumed",
                          _WHAT)
    if (path / CHECKPOINTS_DIR).is_dir() or (path / PLAN_FILE).is_file():
        return Target(root=path / CHECKPOINTS_DIR)
    if path.name == CHECKPOINTS_DIR or (path / LATEST_NAME).is_file() or any(path.glob("step-*")):
        return Target(root=path)
    raise ConfigError(str(path), "is not a run folder, a checkpoints/ folder or a step folder", _WHAT)


def _deepen(info: CheckpointInfo, level: VerifyLevel) -> CheckpointInfo:
    """Re-check a folder that passed the size check at ``level``."""
    if level == "size" or not info.verified:
        return info
    manifest, problem = inspect_checkpoint(info.path, level)
    return replace(info, manifest=manifest, error=problem)


def _resume_order(infos: list[CheckpointInfo]) -> list[CheckpointInfo]:
    """The manager's resume order: ``latest``, then the older folders, newest first."""
    latest = next((info for info in infos if info.is_latest), None)
    if latest is None:
        return list(reversed(infos))
    return [latest, *(info for info in reversed(infos) if info.step < latest.step)]


def _resume_pick(infos: list[CheckpointInfo]) -> CheckpointInfo | None:
    return next((info for info in _resume_order(infos) if info.verified), None)


def collect(target: Target, level: VerifyLevel = "size") -> Listing:
    """Every checkpoint of ``target`` checked by size, and at ``level`` those that are shown."""
    infos = CheckpointManager(target.root, keep=1, verify="size").list()  # refuses folders others can write
    size_ok = frozenset(info.path for info in infos if info.verified)
    if target.only is not None:
        if not any(info.path == target.only for info in infos):
            _manifest, problem = inspect_checkpoint(target.only, "size")
            raise ConfigError(str(target.only), f"is not a checkpoint of {target.root} ({problem or 'a symlink'})",
                              _WHAT)
        infos = [_deepen(info, level) if info.path == target.only else info for info in infos]
    else:
        infos = [_deepen(info, level) for info in infos]
    shown = [info for info in infos if target.only in (None, info.path)]
    return Listing(root=target.root, level=level, infos=shown,
                   latest=next((info for info in infos if info.is_latest), None), resume=_resume_pick(infos),
                   size_ok=size_ok)


def _human_bytes(count: int | None) -> str:
    if count is None:
        return "-"
    value = float(count)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{count} B"


def _row(info: CheckpointInfo, listing: Listing) -> dict[str, Any]:
    manifest = info.manifest
    return {"step": info.step, "folder": info.path.name, "path": str(info.path),
            "bytes": manifest.total_bytes if manifest else None,
            "world_size": manifest.world_size if manifest else None,
            "layout": dict(manifest.layout) if manifest else None,
            "engine": manifest.engine if manifest else None,
            "zero_stage": manifest.zero_stage if manifest and manifest.engine == "deepspeed" else None,
            "dtype": manifest.dtype if manifest else None,
            "verified": info.verified, "problem": info.error, "latest": info.is_latest,
            "resume": listing.resume is not None and listing.resume.path == info.path}


def _as_json(listing: Listing) -> str:
    data = {"checkpoints_dir": str(listing.root), "verify": listing.level,
            "latest": listing.latest.path.name if listing.latest else None,
            "resume": listing.resume.path.name if listing.resume else None,
            "checkpoints": [_row(info, listing) for info in listing.infos]}
    return json_text(data)


def _layout_cell(row: dict[str, Any]) -> str:
    layout = row["layout"]
    if layout is None:
        return "-"
    text = f"{row['world_size']} = t{layout['tensor']} p{layout['pipeline']} d{layout['data']}"
    return text + (f" c{layout['context']}" if layout["context"] > 1 else "")


def _engine_cell(row: dict[str, Any]) -> str:
    return "-" if row["engine"] is None else engine_text(row["engine"], row["zero_stage"])


def _print_table(listing: Listing) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=shown(f"Checkpoints in {listing.root}"), title_justify="left")
    for column in ("step", "folder", "size", "world = layout", "engine", "dtype", f"verified ({listing.level})",
                   "latest", "resume"):
        table.add_column(column, overflow="fold")  # never cut a file name short
    for info in listing.infos:
        row = _row(info, listing)
        table.add_row(str(row["step"]), shown(row["folder"]), _human_bytes(row["bytes"]), shown(_layout_cell(row)),
                      _engine_cell(row), shown(row["dtype"] or "-"),
                      "yes" if row["verified"] else shown(f"no: {row['problem']}"),
                      "<- latest" if row["latest"] else "", "<- resume" if row["resume"] else "")
    Console(width=max(120, Console().width)).print(table)


def _ls(args: argparse.Namespace) -> int:
    listing = collect(resolve_target(args.path), "sha256" if args.sha256 else "size")
    if args.json:
        print(_as_json(listing))
    elif not listing.infos:
        print(plain(f"no checkpoints in {listing.root}"))
    else:
        _print_table(listing)
    return 0


def _verify(args: argparse.Namespace) -> int:
    target = resolve_target(args.path)
    listing = collect(target, "sha256" if args.sha256 else "size")
    if args.json:
        print(_as_json(listing))
    else:
        level = f"checked by {listing.level}"
        for info in listing.infos:
            print(plain(f"{info.path.name}: " + ("ok" if info.verified else f"FAILED: {info.error}")
                        + (f" ({level})" if target.only is not None else "")))
        if target.only is None:
            print(plain(_verdict(listing, level)))
    if target.only is not None:
        return 0 if listing.infos[0].verified else 1
    return 0 if listing.resume is not None else 1


def _verdict(listing: Listing, level: str) -> str:
    if not listing.infos:
        return f"no checkpoints in {listing.root}: a resume would start from step 0"
    if listing.resume is None:
        return f"no checkpoint verifies ({level}): a resume would start from step 0"
    note = ""
    latest = listing.latest
    if latest is not None and latest.path != listing.resume.path:
        note = f"; latest names {latest.path.name}, which does not verify"
        if latest.path in listing.size_ok:
            note += ' (its sizes match, so a run with checkpoint.verify = "size" would still load it: move it aside)'
    return f"resume would use {listing.resume.path.name} ({level}){note}"


def _export_source(target: Target) -> CheckpointInfo:
    """The step folder given, or the one resume would use, verified with sha256 before anything loads. Only the
    folders tried are hashed: the first that passes ends the search. A folder export cannot read is refused
    before it is hashed."""
    from hpc_train.checkpoint.export_checks import check_engine

    listing = collect(target, "size")
    first = listing.infos[0] if target.only is not None else (_resume_order(listing.infos) or [None])[0]
    if first is not None and first.manifest is not None:
        check_engine(first.path, first.manifest)
    if target.only is not None:
        info = _deepen(listing.infos[0], "sha256")
        if not info.verified:
            raise ConfigError(str(info.path), f"does not verify: {info.error}",
                              f"export another step; python -m hpc_train ckpt verify {target.root} --sha256 lists "
                              "which are whole")
        return info
    for candidate in _resume_order(listing.infos):
        info = _deepen(candidate, "sha256")
        if info.verified:
            return info
    found = f"has {len(listing.infos)} checkpoint(s), none verifies (sha256)" if listing.infos else \
        "holds no checkpoints"
    raise ConfigError(str(target.root), found, f"python -m hpc_train ckpt verify {target.root} --sha256 names each "
                      "problem; train further, or export a step folder that verifies")


def _check_export_out(args: argparse.Namespace) -> None:
    """``--out`` (and with pt its ``FILE.json``) through the one check of outputs (:func:`check_output`), then
    the exporter's own (which writes by rename, refusing a file that appeared since without ``--force``)."""
    from hpc_train.checkpoint.export_checks import check_out_folder, check_out_path
    from hpc_train.checkpoint.exported import sidecar_path

    if args.format == "hf":
        check_output(args.out, example="model-hf", replace=args.force, folder=True)
        check_out_folder(args.out, args.force)
        return
    for path in (args.out, sidecar_path(args.out)) if args.format == "pt" else (args.out,):
        check_output(path, example="model.safetensors", replace=args.force)
    check_out_path(args.out, args.force, sidecar=args.format == "pt")


def _export(args: argparse.Namespace) -> int:
    from hpc_train.checkpoint.export import export_checkpoint, export_hf

    target = resolve_target(args.path)
    _check_export_out(args)  # before hashing gigabytes
    info = _export_source(target)
    if info.manifest is None:  # a verified folder always has one
        raise ConfigError(str(info.path), "has no manifest", "export another step")
    if args.format == "hf":
        result = export_hf(info.path, info.manifest, args.out, force=args.force, dtype=args.dtype)
    else:
        result = export_checkpoint(info.path, info.manifest, args.out, force=args.force, fmt=args.format,
                                   dtype=args.dtype)
    summary = {"out": str(result.out), "source": str(result.source), "step": result.step, "tensors": result.tensors,
               "parameters": result.parameters, "bytes": result.bytes, "file_bytes": result.file_bytes,
               "format": result.format, "dtype": result.dtype}
    if args.json:
        print_json(summary, indent=None)
        return 0
    print(plain(f"wrote {result.out} ({result.format}) from {result.source.name}: {result.tensors} tensors, "
                f"{result.parameters:,} parameters, {result.bytes:,} bytes of {result.dtype} "
                f"({_human_bytes(result.file_bytes)} on disk)"))
    return 0


def add_parser(commands: Any) -> None:
    """Add ``ckpt`` and its subcommands to the ``python -m hpc_train`` subparsers ``commands``."""
    ckpt = commands.add_parser("ckpt", help="list, verify or export a run's checkpoints",
                               description="List, verify or export the checkpoints of a run (exit status: 0 done, "
                               "1 verify found none a resume could use, 2 bad input).")
    actions = ckpt.add_subparsers(dest="ckpt_command", required=True, parser_class=type(ckpt))
    path_help = "a run folder (runs/NAME), its checkpoints/ folder, or one step-NNNNNNNN folder"
    ls = actions.add_parser("ls", help="a table of the checkpoints: step, size, layout, verified, latest, resume")
    verify = actions.add_parser("verify", help="check every file against the manifest; exit 1 if resume has none")
    export = actions.add_parser("export", help="write one consolidated state dict of the model (tensor-parallel "
                                "shards merged): safetensors (recommended), pt or a Hugging Face folder")
    for parser in (ls, verify, export):
        parser.add_argument("path", type=Path, metavar="RUN_OR_CHECKPOINT", help=path_help)
        parser.add_argument("--json", action="store_true", help="print the result as JSON")
    for parser in (ls, verify):
        parser.add_argument("--sha256", action="store_true", help="also hash every file (reads all of it)")
    export.add_argument("--out", type=Path, required=True, metavar="FILE",
                        help="the file to write (mode 0600; with --format pt also FILE.json, the model's "
                        "description), or with --format hf the folder")
    export.add_argument("--format", choices=("pt", "safetensors", "hf"), default="pt",
                        help="safetensors (recommended: no pickle, loads anywhere, the model's description in its "
                        "metadata, hpc_train.rank.train.load_exported rebuilds the built-in GPT); pt (the default): a "
                        "torch state dict under the module's own parameter names (torch.load with "
                        "weights_only=True); hf: a Hugging Face model's save_pretrained folder (config.json, "
                        "model.safetensors)")
    export.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32",
                        help="fp32 (default): the fp32 master weights; bf16: floating tensors cast to bf16, "
                        "integer buffers kept")
    export.add_argument("--force", action="store_true",
                        help="replace FILE (and FILE.json with --format pt) if it exists")
    ls.set_defaults(run=_ls)
    verify.set_defaults(run=_verify)
    export.set_defaults(run=_export)

