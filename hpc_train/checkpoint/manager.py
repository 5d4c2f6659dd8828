"""Transactional checkpoint folders: no crash at any moment can leave a run without a good checkpoint.

Layout of ``RUN_DIR/checkpoints/``::

    .tmp-step-00000200-4242/   a writer is filling it (or crashed while doing so): never resumed from
    step-00000100/             committed: every file fsynced, then manifest.json, then renamed into place
    latest                     a small file holding "step-00000100"; moved only after the rename is durable

The order in :meth:`CheckpointManager.commit` is the whole promise (notes C1: temp + fsync(file) + rename +
fsync(dir); torchtitan counts a step folder only with its metadata; KempnerForge moves ``latest`` only after
the flush). A crash before the rename leaves a ``.tmp-*`` folder that :meth:`begin` removes later; a crash
after the rename but before ``latest`` moves leaves ``latest`` on the previous checkpoint, which stays the one
resumed. On resume, :meth:`latest_verified` checks sizes (and sha256 when configured) against the manifest and
falls back, with a warning, to the previous good folder.

The manager only handles folders of files; whatever wrote them (DeepSpeed, torch.save) is the caller's
business, so this module imports no torch and works on a login node (``ckpt ls/verify``). One writer per
``checkpoints/`` folder (rank 0 of one job): :meth:`begin` removes every stale temporary folder of this user.
"""

from __future__ import annotations

import logging
import os
import shutil
import stat
import threading
import time
from collections.abc import Collection, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from hpc_train.checkpoint.manifest import MANIFEST_NAME, FileEntry, Manifest, sha256_file
from hpc_train.checkpoint.names import LATEST_NAME, STEP_FOLDER, TMP_FOLDER, TRASH_FOLDER, step_folder_name
from hpc_train.errors import ConfigError
from hpc_train.run.files import atomic_write, open_record, refuse_shared_writable

__all__ = ["LATEST_NAME", "CheckpointError", "CheckpointInfo", "CheckpointManager", "VerifyLevel",
           "fsync_path", "inspect_checkpoint", "list_files", "step_folder_name"]

log = logging.getLogger(__name__)

VerifyLevel = Literal["size", "sha256"]


class CheckpointError(RuntimeError):
    """A checkpoint folder that cannot be committed or trusted; the message names the folder and the problem."""


@dataclass(frozen=True)
class CheckpointInfo:
    """One step folder as ``ckpt ls`` shows it."""

    step: int
    path: Path
    manifest: Manifest | None
    error: str | None
    is_latest: bool

    @property
    def verified(self) -> bool:
        return self.error is None


def fsync_path(path: Path) -> None:
    """fsync a file or folder (never through a symlink): what makes a write or a rename durable."""
    descriptor = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def _is_real_dir(path: Path) -> bool:
    try:
        return stat.S_ISDIR(path.lstat().st_mode)
    except OSError:
        return False


def _walk(folder: Path) -> Iterator[tuple[str, Path, os.stat_result]]:
    """Yield ``(relative posix path, path, lstat)`` for everything below ``folder``, sorted, without following
    symlinks."""
    for entry in sorted(os.scandir(folder), key=lambda e: e.name):
        path = Path(entry.path)
        info = path.lstat()
        relative = path.relative_to(folder).as_posix()
        yield relative, path, info
        if stat.S_ISDIR(info.st_mode):
            for sub_relative, sub_path, sub_info in _walk(path):
                yield f"{relative}/{sub_relative}", sub_path, sub_info


def _seal_files(folder: Path) -> list[FileEntry]:
    """Hash and fsync every file below ``folder`` (then each sub-folder and ``folder``); refuse links and
    special files, which a resume could not trust."""
    entries: list[FileEntry] = []
    folders: list[Path] = []
    for relative, path, info in _walk(folder):
        if stat.S_ISDIR(info.st_mode):
            folders.append(path)
        elif not stat.S_ISREG(info.st_mode):
            raise CheckpointError(f"{folder}: {relative} is not a regular file (links are not allowed)")
        elif relative == MANIFEST_NAME:
            raise CheckpointError(f"{folder}: the writer left its own {MANIFEST_NAME}; that name is reserved")
        else:
            size, digest = sha256_file(path)
            fsync_path(path)
            entries.append(FileEntry(path=relative, size=size, sha256=digest))
    for sub in [*reversed(folders), folder]:
        fsync_path(sub)
    return entries


def list_files(folder: Path) -> list[tuple[str, int]]:
    """``(relative path, size)`` of every file below ``folder``, sorted; links and special files refused."""
    files = []
    for relative, _path, info in _walk(folder):
        if stat.S_ISDIR(info.st_mode):
            continue
        if not stat.S_ISREG(info.st_mode):
            raise CheckpointError(f"{folder}: {relative} is not a regular file (links are not allowed)")
        if relative == MANIFEST_NAME:
            raise CheckpointError(f"{folder}: the writer left its own {MANIFEST_NAME}; that name is reserved")
        files.append((relative, info.st_size))
    return files


def _sealed_elsewhere(folder: Path, entries: list[FileEntry]) -> list[FileEntry]:
    """Check the entries the writers hashed while writing against the folder (each listed file there, with its
    size), hash and fsync what they did not write (files a library put there by itself: small ones), then fsync
    every folder."""
    on_disk = dict(list_files(folder))
    listed = {entry.path: entry.size for entry in entries}
    missing = sorted(set(listed) - set(on_disk))
    changed = sorted(p for p in set(on_disk) & set(listed) if on_disk[p] != listed[p])
    if missing or changed or len(listed) != len(entries):
        raise CheckpointError(f"{folder}: the files the ranks wrote do not match the folder (gone: {missing[:3]}, "
                              f"size changed: {changed[:3]}, listed twice: {len(entries) - len(listed)})")
    others = [FileEntry(path=relative, size=size, sha256=sha256_file(folder / relative)[1])
              for relative, size in sorted(on_disk.items()) if relative not in listed]
    for entry in others:
        fsync_path(folder / entry.path)
    for _relative, path, info in reversed(list(_walk(folder))):
        if stat.S_ISDIR(info.st_mode):
            fsync_path(path)
    fsync_path(folder)
    return sorted([*entries, *others], key=lambda e: e.path)


def _check_file(folder: Path, entry: FileEntry, level: VerifyLevel) -> str | None:
    """The problem with one listed file, or None. Every component is lstat'ed so no link leads outside."""
    path = folder
    for part in entry.path.split("/"):
        path = path / part
        try:
            info = path.lstat()
        except FileNotFoundError:
            return f"{entry.path} is missing"
        except OSError as error:
            return f"{entry.path} cannot be read ({error.strerror or error})"
        if stat.S_ISLNK(info.st_mode):
            return f"{entry.path} goes through a symlink"
    if not stat.S_ISREG(info.st_mode):
        return f"{entry.path} is not a regular file"
    if info.st_size != entry.size:
        kind = "short (truncated)" if info.st_size < entry.size else "long"
        return f"{entry.path} is {kind}: {info.st_size} bytes, manifest says {entry.size}"
    if level == "sha256" and sha256_file(path)[1] != entry.sha256:
        return f"{entry.path} is corrupt: sha256 differs from the manifest"
    return None


_MAX_MANIFEST = 64 << 20


def _read_manifest_text(path: Path) -> str:
    """The manifest's text, opened without following a link or blocking (a FIFO planted as the manifest)."""
    with open_record(path) as handle:
        if os.fstat(handle.fileno()).st_size > _MAX_MANIFEST:
            raise OSError(0, f"larger than {_MAX_MANIFEST >> 20} MB")
        return handle.read(_MAX_MANIFEST).decode("utf-8")


def inspect_checkpoint(folder: Path, level: VerifyLevel = "size") -> tuple[Manifest | None, str | None]:
    """Return ``(manifest or None, problem or None)`` for one step folder; never raises for a bad folder."""
    match = STEP_FOLDER.match(folder.name)
    try:
        info = folder.lstat()
    except OSError as error:
        return None, f"cannot read the folder ({error.strerror or error})"
    if not stat.S_ISDIR(info.st_mode) or match is None:
        return None, "not a step folder"
    try:
        text = _read_manifest_text(folder / MANIFEST_NAME)
    except FileNotFoundError:
        return None, f"no {MANIFEST_NAME} (an incomplete or foreign folder)"
    except (OSError, UnicodeDecodeError) as error:
        return None, f"cannot read {MANIFEST_NAME} ({getattr(error, 'strerror', None) or error})"
    try:
        manifest = Manifest.from_json(text)
    except ValueError as error:
        return None, f"bad {MANIFEST_NAME}: {error}"
    if manifest.step != int(match.group(1)):
        return manifest, f"{MANIFEST_NAME} says step {manifest.step}, the folder name says {int(match.group(1))}"
    listed = {entry.path for entry in manifest.files}
    for entry in manifest.files:
        problem = _check_file(folder, entry, level)
        if problem:
            return manifest, problem
    for relative, _path, lstat_info in _walk(folder):
        if not stat.S_ISDIR(lstat_info.st_mode) and relative != MANIFEST_NAME and relative not in listed:
            return manifest, f"{relative} is not listed in {MANIFEST_NAME}"
    return manifest, None


class CheckpointManager:
    """Begin, commit, prune and find checkpoints under one ``checkpoints/`` folder (see the module doc)."""

    def __init__(self, root: Path, keep: int, verify: VerifyLevel = "size", background_prune: bool = False) -> None:
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise ConfigError("checkpoint.keep", f"must be an integer >= 1, got {keep!r}")
        if verify not in ("size", "sha256"):
            raise ConfigError("checkpoint.verify", f"must be 'size' or 'sha256', got {verify!r}")
        self.root = Path(root)
        self.keep = keep
        self.verify: VerifyLevel = verify
        # Pruning after ``latest`` moved, in a thread, so that a save does not wait for old folders to go.
        self.background_prune = background_prune
        self._pruner: threading.Thread | None = None

    # ----- writing -----

    def begin(self, step: int) -> Path:
        """Create and return a private (0700) temporary folder for step ``step``; the writer fills it."""
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step: must be an integer >= 0, got {step!r}")
        self._ensure_root()
        self.wait()  # the previous commit's pruning: it renames folders in this root too
        self._remove_stale()
        tmp = self.root / f".tmp-{step_folder_name(step)}-{os.getpid()}"
        os.mkdir(tmp, 0o700)
        os.chmod(tmp, 0o700)  # whatever the umask
        return tmp

    def commit(self, tmp: Path, manifest_fields: Mapping[str, Any], sealed: list[FileEntry] | None = None) -> Path:
        """Seal ``tmp`` (fsync, manifest), rename it to ``step-N``, then move ``latest``, then prune.

        ``manifest_fields`` holds the Manifest fields but ``files`` (computed here) and ``step`` (taken from
        the folder; a different value is an error); ``created`` defaults to now. ``sealed``: the files already
        hashed and fsynced by the writers (:func:`hpc_train.checkpoint.writer.write_file`); each
        must be in the folder with its size, and the files they do not list are hashed here.
        With ``background_prune`` the old folders go in a thread after ``latest`` moved (:meth:`wait`).
        """
        tmp, step = self._own_tmp(tmp)
        self.wait()
        files = _seal_files(tmp) if sealed is None else _sealed_elsewhere(tmp, sealed)
        manifest = self._build_manifest(step, manifest_fields, files)
        self._write_manifest(tmp, manifest)
        final = self._publish(tmp, step)
        self._point_latest(final)
        if self.background_prune:
            self._pruner = threading.Thread(target=self._prune_quietly, name=f"prune-before-{final.name}")
            self._pruner.start()
        else:
            self._prune()
        return final

    def wait(self) -> None:
        """Return once a background pruning has finished (a crash during it is safe: see :meth:`_discard`)."""
        if self._pruner is not None:
            self._pruner.join()
            self._pruner = None

    def _prune_quietly(self) -> None:
        try:
            self._prune()
        except OSError as error:  # the checkpoint is committed; a folder left over goes at the next prune
            log.warning("pruning old checkpoints in %s failed: %s; retried after the next save", self.root, error)

    def _build_manifest(self, step: int, fields: Mapping[str, Any], files: list[FileEntry]) -> Manifest:
        given = dict(fields)
        if "files" in given:
            raise ValueError("manifest_fields.files: computed by commit, do not pass it")
        if given.setdefault("step", step) != step:
            raise ValueError(f"manifest_fields.step: {given['step']!r} differs from the folder's step {step}")
        given.setdefault("created", time.time())
        try:
            return Manifest(**given, files=files)
        except TypeError as error:  # unknown or missing field names
            raise ValueError(f"manifest_fields: {error}") from None

    def _write_manifest(self, tmp: Path, manifest: Manifest) -> None:
        atomic_write(tmp / MANIFEST_NAME, manifest.to_json())  # fsyncs the file and tmp/

    def _publish(self, tmp: Path, step: int) -> Path:
        """Rename ``tmp`` to ``step-N`` and fsync ``checkpoints/``; an older folder of that step goes to trash."""
        final = self.root / step_folder_name(step)
        trash = self.root / f".trash-{final.name}-{os.getpid()}"
        replaced = final.exists() or final.is_symlink()
        if replaced:
            os.replace(final, trash)
        os.rename(tmp, final)
        fsync_path(self.root)
        if replaced and trash.is_dir() and not trash.is_symlink():  # the new folder is durable: drop the old one
            shutil.rmtree(trash, ignore_errors=True)
        elif replaced:
            trash.unlink(missing_ok=True)
        return final

    def _point_latest(self, final: Path) -> None:
        # A small file rather than a symlink: atomic_write replaces it with one rename and fsyncs the folder,
        # it reads the same on every filesystem (some shared ones and object-store mounts lack symlinks),
        # and a reader never follows a link, so a planted ``latest`` cannot point outside checkpoints/.
        atomic_write(self.root / LATEST_NAME, final.name + "\n")

    def _prune(self) -> None:
        """Keep the last ``keep`` folders up to ``latest``; never the one ``latest`` names, never the newest
        verified. Folders newer than ``latest`` (left by a crash after rename) are not touched."""
        latest = self._read_latest()
        steps = self._step_folders()
        if latest is None:
            return
        older = [(step, path) for step, path in steps if step <= latest[0]]
        doomed = older[:-self.keep]
        protected = {latest[1].name}
        for _step, path in reversed(older):
            if inspect_checkpoint(path, "size")[1] is None:
                protected.add(path.name)
                break
        for step, path in doomed:
            if path.name not in protected:
                self._discard(path, step)

    def _discard(self, path: Path, step: int) -> None:
        """Rename to ``.trash-*`` first, so a crash mid-delete never leaves a half folder named ``step-N``."""
        trash = self.root / f".trash-{step_folder_name(step)}-{os.getpid()}"
        os.replace(path, trash)
        fsync_path(self.root)
        shutil.rmtree(trash, ignore_errors=True)

    # ----- reading -----

    def latest_verified(self, level: VerifyLevel | None = None, skip: Collection[Path] = ()) -> Path | None:
        """The folder to resume from: ``latest`` if it verifies, else the newest older one that does. ``level``
        overrides ``verify`` (a loader that hashes while it reads asks for sizes here); ``skip``: folders a load
        already found damaged."""
        if not self._root_usable():
            return None
        for path in self._candidates():
            if path in skip:
                continue
            _manifest, problem = inspect_checkpoint(path, level or self.verify)
            if problem is None:
                return path
            log.warning("checkpoint %s skipped: %s; falling back to the previous one", path, problem)
        log.warning("no usable checkpoint in %s", self.root)
        return None

    def list(self) -> list[CheckpointInfo]:
        """Every step folder, oldest first, with its manifest (or None) and its problem (or None)."""
        if not self._root_usable():
            return []
        latest = self._read_latest(warn=False)
        infos = []
        for step, path in self._step_folders():
            manifest, problem = inspect_checkpoint(path, self.verify)
            infos.append(CheckpointInfo(step, path, manifest, problem,
                                        is_latest=latest is not None and latest[1] == path))
        return infos

    def _candidates(self) -> list[Path]:
        steps = self._step_folders()
        latest = self._read_latest()
        if latest is None:
            return [path for _step, path in reversed(steps)]
        return [latest[1], *(path for step, path in reversed(steps) if step < latest[0])]

    def _read_latest(self, warn: bool = True) -> tuple[int, Path] | None:
        """``(step, folder)`` that ``latest`` names, or None when it is missing or does not name a step folder."""
        path = self.root / LATEST_NAME
        try:
            info = path.lstat()
            text = path.read_text(encoding="utf-8").strip() if stat.S_ISREG(info.st_mode) else None
        except FileNotFoundError:
            return None
        except (OSError, UnicodeDecodeError):
            text = None
        match = STEP_FOLDER.match(text) if text else None
        target = self.root / match.group(0) if match else None
        if match is None or target is None or not _is_real_dir(target):
            if warn:
                log.warning("%s holds %r, not an existing step folder; using the newest step folder instead",
                            path, (text or "")[:80])
            return None
        return int(match.group(1)), target

    def _step_folders(self) -> list[tuple[int, Path]]:
        found = []
        for entry in os.scandir(self.root):
            match = STEP_FOLDER.match(entry.name)
            if match and entry.is_dir(follow_symlinks=False):
                found.append((int(match.group(1)), Path(entry.path)))
        return sorted(found)

    # ----- the folder itself -----

    def _ensure_root(self) -> None:
        old_umask = os.umask(0o077)
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        finally:
            os.umask(old_umask)
        self._refuse_unsafe_root()

    def _root_usable(self) -> bool:
        if not self.root.exists():
            return False
        self._refuse_unsafe_root()
        return True

    def _refuse_unsafe_root(self) -> None:
        # Others who can write here could plant a checkpoint (pickles that run code when loaded).
        if self.root.is_symlink() or not self.root.is_dir():
            raise ConfigError(str(self.root), "is not a folder (or is a symlink)", "remove it or pick another run")
        refuse_shared_writable(self.root)

    def _own_tmp(self, tmp: Path) -> tuple[Path, int]:
        tmp = Path(tmp)
        match = TMP_FOLDER.match(tmp.name)
        if match is None or tmp.parent.resolve() != self.root.resolve() or tmp.is_symlink() or not tmp.is_dir():
            raise CheckpointError(f"{tmp}: not a temporary folder made by begin() in {self.root}")
        return self.root / tmp.name, int(match.group(1))

    def _remove_stale(self) -> None:
        """Remove ``.tmp-*`` (crashed writers) and ``.trash-*`` (crashed deletes) folders owned by this user."""
        uid = os.getuid()
        for entry in os.scandir(self.root):
            if not (TMP_FOLDER.match(entry.name) or TRASH_FOLDER.match(entry.name)):
                continue
            info = entry.stat(follow_symlinks=False)
            if stat.S_ISDIR(info.st_mode) and info.st_uid == uid:
                log.info("removing %s, left by an interrupted save", entry.path)
                shutil.rmtree(entry.path, ignore_errors=True)
