"""Resuming on a different number of data-parallel ranks: DeepSpeed's universal checkpoint, made once and cached.

ZeRO (stages 1-3) keeps each data-parallel rank's slice of the optimizer state (fp32 weights, Adam moments) in
its own file, cut for the data-parallel size that saved it; DeepSpeed refuses to load those files at any other
size. Its universal checkpoint (``deepspeed.checkpoint.ds_to_universal``) stores every parameter's state whole,
one folder per parameter, and a load with ``checkpoint.load_universal`` cuts it again for the ranks at hand.

Only the data-parallel size may differ: the model axes (tensor, pipeline, context) decide how each parameter
is sliced and which layers a rank holds, and re-slicing them needs per-parameter patterns (which dimension a
tensor-parallel weight is split on) that this trainer's model does not publish. :func:`compare_layouts`
refuses such a change before anything is loaded.

The converted copy lives in ``checkpoints/.universal/step-NNNNNNNN/`` (private, 0700), never in the sealed
step folder, whose manifest must keep verifying. The checkpoint manager only looks at ``step-*``, ``.tmp-step-*``
and ``.trash-step-*`` names, so it neither lists, prunes nor cleans this folder; this module does. A copy is
written under a temporary name and renamed when whole, records the sha256 of the manifest it came from
(``source.json``), and is reused only for that same sealed checkpoint; the cache holds at most one copy, since
the first save at the new size makes it useless. The converter runs as a child process: its prints and worker
pool stay out of the rank's process, and a time limit lets rank 0 report a slow conversion before the other
ranks' collective timeout does.

No torch import: the manager's package stays usable on login nodes.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import stat
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path

from hpc_train.checkpoint.manager import CheckpointError, fsync_path
from hpc_train.checkpoint.manifest import MANIFEST_NAME
from hpc_train.errors import ConfigError
from hpc_train.run.files import atomic_write, refuse_shared_writable

__all__ = ["CACHE_NAME", "MODEL_AXES", "SOURCE_NAME", "cached_copy", "clear_cache", "compare_layouts",
           "convert_to_universal", "describe_layout", "optimizer_is_partitioned"]

CACHE_NAME = ".universal"
SOURCE_NAME = "source.json"
MODEL_AXES = ("tensor", "pipeline", "context")
_OWN = re.compile(r"^(?:\.tmp-|\.trash-)?step-[0-9]{8,}(?:-[0-9]+)*$")
_TAIL_CHARS = 3000


def describe_layout(layout: Mapping[str, int], world: int, every_axis: bool = False) -> str:
    """``"2 ranks (data 2)"``: the data size and the model axes that are not 1 (all but context with
    ``every_axis``, for errors about them; context only when it is not 1, as it rarely is)."""
    axes = [axis for axis in (*MODEL_AXES, "data")
            if axis == "data" or layout[axis] != 1 or (every_axis and axis != "context")]
    sizes = ", ".join(f"{axis} {layout[axis]}" for axis in axes)
    return f"{world} rank{'s' if world != 1 else ''} ({sizes})"


def compare_layouts(where: str, saved: Mapping[str, int], saved_world: int, current: Mapping[str, int],
                    current_world: int) -> bool:
    """True when only the data-parallel size differs (a conversion may be needed), False when nothing does.

    A different model axis is a ConfigError naming both layouts and the ways out: it is raised before anything
    is loaded, because DeepSpeed would otherwise fail deep inside the load, or load wrongly sliced weights.
    """
    changed = [axis for axis in MODEL_AXES if saved[axis] != current[axis]]
    if changed:
        names = " and ".join(changed)
        keep = ", ".join(f"parallel.{axis} = {saved[axis]}" for axis in changed)
        raise ConfigError(
            where, f"saved by {describe_layout(saved, saved_world, True)}, but this job runs "
            f"{describe_layout(current, current_world, True)}: the {names} size cannot change on resume, only the "
            "data-parallel size can (DeepSpeed re-partitions ZeRO state across data-parallel ranks; re-slicing the "
            "model's own weights across tensor or pipeline ranks is not supported)",
            f"set {keep} to resume this run, or start a new run (another job.name), or set "
            "checkpoint.resume = false to start this one over")
    return saved["data"] != current["data"]


def optimizer_is_partitioned(state_dir: Path) -> bool:
    """Whether DeepSpeed cut the optimizer state per data-parallel rank (ZeRO 1-3, or bf16 under pipelines):
    then the files say so by name. Without them (ZeRO stage 0) every rank loads the whole state as it is."""
    return any(path.name.endswith("optim_states.pt") for path in state_dir.iterdir())


def cached_copy(sealed: Path, tag: str) -> Path | None:
    """The folder of an earlier conversion of this very sealed checkpoint (the step folder may have been saved
    again since: the copy records its manifest's sha256), or None."""
    final = sealed.parent / CACHE_NAME / sealed.name
    if not (final.parent.is_dir() and _matches(final, _manifest_digest(sealed), tag)):
        return None
    _cache_root(sealed.parent)  # refuses a cache others could have planted pickles in
    return final


def convert_to_universal(sealed: Path, tag: str, timeout_s: float | None = None,
                         workers: int = 1) -> tuple[Path, float]:
    """Convert the sealed step folder ``sealed`` (DeepSpeed's files under ``sealed / tag``) into the cache, and
    return the copy's folder (DeepSpeed loads ``folder / tag``) and the seconds it took. One process: call it on
    one rank only. The sealed folder is only read; earlier copies are dropped."""
    cache = _cache_root(sealed.parent)
    _clear(cache)
    tmp = cache / f".tmp-{sealed.name}-{os.getpid()}"
    os.mkdir(tmp, 0o700)
    start = time.monotonic()
    try:
        _convert(sealed / tag, tmp / tag, timeout_s, workers)
        seconds = time.monotonic() - start
        _fsync_tree(tmp)
        atomic_write(tmp / SOURCE_NAME, json.dumps({"source": str(sealed), "manifest_sha256": _manifest_digest(sealed),
                                                     "seconds": round(seconds, 3)}, indent=1) + "\n")
        final = cache / sealed.name
        os.rename(tmp, final)
        fsync_path(cache)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final, seconds


def clear_cache(checkpoints: Path) -> None:
    """Drop every converted copy: called when a resume needs none, since checkpoints saved at the current size
    have made them useless (each is as large as the optimizer state)."""
    cache = checkpoints / CACHE_NAME
    if cache.is_dir() and not cache.is_symlink():
        _clear(cache)


def _cache_root(checkpoints: Path) -> Path:
    """``checkpoints/.universal``, private and ours: its pickles are loaded as code would be."""
    cache = checkpoints / CACHE_NAME
    old_umask = os.umask(0o077)
    try:
        cache.mkdir(mode=0o700, exist_ok=True)
    finally:
        os.umask(old_umask)
    if cache.is_symlink() or not cache.is_dir():
        raise ConfigError(str(cache), "is not a folder (or is a symlink)", "remove it; it only caches conversions")
    refuse_shared_writable(cache)
    return cache


def _manifest_digest(sealed: Path) -> str:
    return hashlib.sha256((sealed / MANIFEST_NAME).read_bytes()).hexdigest()


def _matches(final: Path, key: str, tag: str) -> bool:
    """A complete copy of the same sealed checkpoint (the step folder may have been saved again since)."""
    try:
        if final.is_symlink() or not (final / tag).is_dir():
            return False
        source = json.loads((final / SOURCE_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(source, dict) and source.get("manifest_sha256") == key


def _clear(cache: Path) -> None:
    """Remove our entries (copies, crashed conversions, half deletes) owned by this user; renamed to
    ``.trash-*`` first, so a crash mid-delete never leaves a half copy under a name that could be reused."""
    uid = os.getuid()
    for entry in os.scandir(cache):
        info = entry.stat(follow_symlinks=False)
        if not _OWN.match(entry.name) or not stat.S_ISDIR(info.st_mode) or info.st_uid != uid:
            continue
        path = Path(entry.path)
        if not entry.name.startswith(".trash-"):
            trash = cache / f".trash-{entry.name.removeprefix('.tmp-')}-{os.getpid()}"
            os.replace(path, trash)
            path = trash
        shutil.rmtree(path, ignore_errors=True)


def _convert(source: Path, output: Path, timeout_s: float | None, workers: int) -> None:
    """Run DeepSpeed's converter on ``source`` into ``output``; its output is kept for the error only."""
    command = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", str(source),
               "--output_folder", str(output), "--inject_missing_state", "--num_extract_workers", str(workers),
               "--num_merge_workers", str(workers)]
    by_hand = " ".join(command[:-4])
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired:
        raise CheckpointError(f"{source}: converting to a universal checkpoint took more than {timeout_s:.0f} s, "
                              "longer than the other ranks can wait. Raise dist.timeout_s, or convert by hand "
                              f"({by_hand}) and resume again") from None
    if result.returncode != 0:
        tail = (result.stdout + result.stderr)[-_TAIL_CHARS:]
        raise CheckpointError(f"{source}: DeepSpeed's ds_to_universal failed (exit {result.returncode}); resume on "
                              f"the ranks that saved it, or set checkpoint.resume = false. Its output ends:\n{tail}")


def _fsync_tree(folder: Path) -> None:
    """Every file, then every folder bottom-up: the rename that publishes the copy comes after its data."""
    folders = []
    for root, _dirs, files in os.walk(folder):
        folders.append(Path(root))
        for name in files:
            fsync_path(Path(root) / name)
    for path in reversed(folders):
        fsync_path(path)
