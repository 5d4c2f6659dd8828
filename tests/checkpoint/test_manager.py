"""The checkpoint manager on real files: every crash point leaves the previous checkpoint the one resumed.

CrashErrores are simulated by making one internal step of ``commit`` raise (the process "dies" there) and then
asking a fresh manager, as a requeued job would, what to resume from; one test SIGKILLs a real writer.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import signal
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from hpc_train.checkpoint import (
    LATEST_NAME,
    MANIFEST_NAME,
    CheckpointError,
    CheckpointManager,
    FileEntry,
    Manifest,
    inspect_checkpoint,
    sha256_file,
)
from hpc_train.checkpoint import manager as manager_module
from hpc_train.errors import ConfigError

FIELDS = {"world_size": 2, "layout": {"tensor": 1, "pipeline": 1, "data": 2, "context": 1}, "zero_stage": 2,
          "dtype": "bf16", "config_hash": "c0ffee"}
FILES = ("model_states.pt", "zero/rank0_optim.pt", "zero/rank1_optim.pt")


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return tmp_path / "run" / "checkpoints"


def write_files(folder: Path, step: int) -> None:
    for index, name in enumerate(FILES):
        path = folder / name
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(bytes([step % 251, index]) * (1000 + 10 * index))


def save(manager: CheckpointManager, step: int) -> Path:
    tmp = manager.begin(step)
    write_files(tmp, step)
    return manager.commit(tmp, FIELDS)


def resumed(root: Path, verify: str = "sha256") -> Path | None:
    """What a requeued job would resume from: a fresh manager, as after a restart."""
    return CheckpointManager(root, keep=3, verify=verify).latest_verified()  # type: ignore[arg-type]


def latest_text(root: Path) -> str:
    return (root / LATEST_NAME).read_text().strip()


def temp_folders(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name.startswith((".tmp-", ".trash-")))


# ----- round trip -----

def test_commit_then_resume_round_trip(root: Path) -> None:
    manager = CheckpointManager(root, keep=3, verify="sha256")
    final = save(manager, 100)
    assert final == root / "step-00000100"
    assert latest_text(root) == "step-00000100"
    assert temp_folders(root) == []
    manifest = Manifest.from_json((final / MANIFEST_NAME).read_text())
    assert manifest.step == 100 and manifest.zero_stage == 2 and manifest.layout["data"] == 2
    assert [entry.path for entry in manifest.files] == sorted(FILES)
    for entry in manifest.files:
        assert sha256_file(final / entry.path) == (entry.size, entry.sha256)
    assert manager.latest_verified() == final
    [info] = manager.list()
    assert (info.step, info.verified, info.is_latest, info.manifest) == (100, True, True, manifest)


def test_folders_are_private(root: Path) -> None:
    old = os.umask(0)
    try:
        manager = CheckpointManager(root, keep=2)
        tmp = manager.begin(5)
    finally:
        os.umask(old)
    assert stat.S_IMODE(root.stat().st_mode) == 0o700
    assert stat.S_IMODE(tmp.stat().st_mode) == 0o700
    write_files(tmp, 5)
    final = manager.commit(tmp, FIELDS)
    assert stat.S_IMODE(final.stat().st_mode) == 0o700
    assert stat.S_IMODE((root / LATEST_NAME).stat().st_mode) == 0o600


def test_shared_writable_checkpoints_folder_is_refused(root: Path) -> None:
    manager = CheckpointManager(root, keep=2)
    save(manager, 1)
    root.chmod(0o777)
    with pytest.raises(ConfigError, match="writable by others"):
        manager.begin(2)
    with pytest.raises(ConfigError, match="writable by others"):
        manager.latest_verified()


def test_missing_root_has_nothing_to_resume(root: Path) -> None:
    manager = CheckpointManager(root, keep=1)
    assert manager.latest_verified() is None
    assert manager.list() == []
    assert not root.exists()  # reading creates nothing


@pytest.mark.parametrize(("keep", "verify"), [(0, "size"), (True, "size"), (2, "md5")])
def test_bad_settings_are_config_errors(root: Path, keep: int, verify: str) -> None:
    with pytest.raises(ConfigError):
        CheckpointManager(root, keep=keep, verify=verify)  # type: ignore[arg-type]


# ----- the commit order and each crash point -----

def test_commit_order_is_fsync_manifest_rename_fsync_latest(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    manager = CheckpointManager(root, keep=3)
    tmp = manager.begin(7)
    write_files(tmp, 7)
    events: list[str] = []
    real_fsync, real_write, real_rename = manager_module.fsync_path, manager_module.atomic_write, os.rename

    def fsync(path: Path) -> None:
        events.append(f"fsync {Path(path).relative_to(root.parent)}")
        real_fsync(path)

    def write(path: Path, text: str, mode: int = 0o600) -> None:
        events.append(f"write {path.relative_to(root.parent)}")
        real_write(path, text, mode)

    def rename(src: str | Path, dst: str | Path) -> None:
        events.append(f"rename {Path(dst).relative_to(root.parent)}")
        real_rename(src, dst)

    monkeypatch.setattr(manager_module, "fsync_path", fsync)
    monkeypatch.setattr(manager_module, "atomic_write", write)
    monkeypatch.setattr(manager_module.os, "rename", rename)
    manager.commit(tmp, FIELDS)
    name = tmp.name
    assert events == [
        f"fsync checkpoints/{name}/model_states.pt",
        f"fsync checkpoints/{name}/zero/rank0_optim.pt",
        f"fsync checkpoints/{name}/zero/rank1_optim.pt",
        f"fsync checkpoints/{name}/zero",
        f"fsync checkpoints/{name}",
        f"write checkpoints/{name}/{MANIFEST_NAME}",
        "rename checkpoints/step-00000007",
        "fsync checkpoints",
        "write checkpoints/latest",
    ]


class CrashError(Exception):
    """The process 'dies' here."""


def crash(*_args: object, **_kwargs: object) -> None:
    raise CrashError


@pytest.mark.parametrize("point", ["_seal_files", "_write_manifest", "_publish", "_point_latest"])
def test_crash_at_each_commit_step_resumes_the_previous_checkpoint(
        root: Path, monkeypatch: pytest.MonkeyPatch, point: str) -> None:
    manager = CheckpointManager(root, keep=3, verify="sha256")
    good = save(manager, 100)
    tmp = manager.begin(200)
    write_files(tmp, 200)
    target = manager_module if point == "_seal_files" else CheckpointManager
    with monkeypatch.context() as patch:
        patch.setattr(target, point, crash)
        with pytest.raises(CrashError):
            manager.commit(tmp, FIELDS)
    assert latest_text(root) == "step-00000100"
    assert resumed(root) == good
    # the next save cleans up and moves on
    after = save(CheckpointManager(root, keep=3, verify="sha256"), 300)
    assert temp_folders(root) == []
    assert resumed(root) == after


def test_crash_after_some_files_resumes_the_previous_checkpoint(root: Path) -> None:
    manager = CheckpointManager(root, keep=3)
    good = save(manager, 100)
    tmp = manager.begin(200)
    (tmp / "model_states.pt").write_bytes(b"half")  # the writer dies here; commit is never called
    assert resumed(root) == good
    CheckpointManager(root, keep=3).begin(300)
    assert not tmp.exists()


def test_crash_after_rename_keeps_latest_and_the_orphan(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    manager = CheckpointManager(root, keep=1)
    save(manager, 100)
    tmp = manager.begin(200)
    write_files(tmp, 200)
    with monkeypatch.context() as patch:
        patch.setattr(CheckpointManager, "_point_latest", crash)
        with pytest.raises(CrashError):
            manager.commit(tmp, FIELDS)
    assert resumed(root) == root / "step-00000100"  # latest is the commit point, not the newest folder
    save(manager, 150)  # the resumed run goes on; keep=1 drops 100, but never the folder newer than latest
    assert sorted(p.name for p in root.glob("step-*")) == ["step-00000150", "step-00000200"]
    assert resumed(root) == root / "step-00000150"


# ----- damaged checkpoints are skipped with a warning -----

def truncate(folder: Path) -> None:
    path = folder / "zero/rank1_optim.pt"
    path.write_bytes(path.read_bytes()[:-7])


def extend(folder: Path) -> None:
    with open(folder / "zero/rank0_optim.pt", "ab") as handle:
        handle.write(b"x")


def flip(folder: Path) -> None:
    path = folder / "model_states.pt"
    data = bytearray(path.read_bytes())
    data[500] ^= 0x01
    path.write_bytes(bytes(data))


def remove_file(folder: Path) -> None:
    (folder / "zero/rank0_optim.pt").unlink()


def remove_manifest(folder: Path) -> None:
    (folder / MANIFEST_NAME).unlink()


def garble_manifest(folder: Path) -> None:
    (folder / MANIFEST_NAME).write_text('{"step": 200,')


def unsafe_manifest_path(folder: Path) -> None:
    data = json.loads((folder / MANIFEST_NAME).read_text())
    data["files"][0]["path"] = "../step-00000100/model_states.pt"
    (folder / MANIFEST_NAME).write_text(json.dumps(data))


def wrong_step_manifest(folder: Path) -> None:
    data = json.loads((folder / MANIFEST_NAME).read_text())
    data["step"] = 100
    (folder / MANIFEST_NAME).write_text(json.dumps(data))


def unlisted_file(folder: Path) -> None:
    (folder / "zero/rank2_optim.pt").write_bytes(b"planted")


def symlinked_file(folder: Path) -> None:
    path = folder / "model_states.pt"
    outside = folder.parent.parent / "elsewhere.pt"
    outside.write_bytes(path.read_bytes())
    path.unlink()
    path.symlink_to(outside)


@pytest.mark.parametrize(("damage", "problem"), [
    (truncate, "rank1_optim.pt is short"),
    (extend, "rank0_optim.pt is long"),
    (flip, "model_states.pt is corrupt"),
    (remove_file, "rank0_optim.pt is missing"),
    (remove_manifest, "no manifest.json"),
    (garble_manifest, "not valid JSON"),
    (unsafe_manifest_path, "manifest.files[0].path"),
    (wrong_step_manifest, "says step 100"),
    (unlisted_file, "rank2_optim.pt is not listed"),
    (symlinked_file, "goes through a symlink"),
])
def test_damaged_newest_checkpoint_falls_back(root: Path, caplog: pytest.LogCaptureFixture, damage, problem) -> None:
    manager = CheckpointManager(root, keep=3, verify="sha256")
    good = save(manager, 100)
    bad = save(manager, 200)
    damage(bad)
    with caplog.at_level(logging.WARNING, logger="hpc_train.checkpoint.manager"):
        assert manager.latest_verified() == good
    assert str(bad) in caplog.text and problem in caplog.text
    info = {i.step: i for i in manager.list()}
    assert info[100].verified and not info[200].verified and problem in (info[200].error or "")


def test_size_level_does_not_read_contents(root: Path) -> None:
    manager = CheckpointManager(root, keep=3, verify="size")
    save(manager, 100)
    bad = save(manager, 200)
    flip(bad)
    assert manager.latest_verified() == bad  # a flipped byte needs verify="sha256"
    assert resumed(root, verify="sha256") == root / "step-00000100"


def test_every_checkpoint_damaged_gives_none(root: Path, caplog: pytest.LogCaptureFixture) -> None:
    manager = CheckpointManager(root, keep=3)
    truncate(save(manager, 1))
    remove_manifest(save(manager, 2))
    with caplog.at_level(logging.WARNING):
        assert manager.latest_verified() is None
    assert "no usable checkpoint" in caplog.text


@pytest.mark.parametrize("content", ["step-00000300\n", "../../etc\n", "step-1\n", "", "\x00\xff garbage"])
def test_stale_or_garbage_latest_uses_the_newest_good_folder(root: Path, caplog: pytest.LogCaptureFixture,
                                                              content: str) -> None:
    manager = CheckpointManager(root, keep=3)
    save(manager, 100)
    newest = save(manager, 200)
    (root / LATEST_NAME).write_text(content, encoding="latin-1")
    with caplog.at_level(logging.WARNING):
        assert manager.latest_verified() == newest
    assert "not an existing step folder" in caplog.text


def test_latest_as_a_symlink_is_not_followed(root: Path, tmp_path: Path) -> None:
    manager = CheckpointManager(root, keep=3)
    newest = save(manager, 200)
    (tmp_path / "evil").write_text("step-00000200")
    (root / LATEST_NAME).unlink()
    (root / LATEST_NAME).symlink_to(tmp_path / "evil")
    assert manager.latest_verified() == newest  # found as the newest folder, not through the link


def test_latest_on_a_damaged_folder_falls_back_to_an_older_one(root: Path) -> None:
    manager = CheckpointManager(root, keep=3)
    save(manager, 100)
    middle = save(manager, 200)
    truncate(save(manager, 300))
    assert resumed(root) == middle


# ----- retention -----

def steps_on_disk(root: Path) -> list[str]:
    return sorted(p.name for p in root.glob("step-*"))


def test_keep_one_keeps_only_the_newest(root: Path) -> None:
    manager = CheckpointManager(root, keep=1)
    for step in (100, 200, 300):
        save(manager, step)
        assert steps_on_disk(root) == [f"step-{step:08d}"]
        assert resumed(root) == root / f"step-{step:08d}"
    assert temp_folders(root) == []


def test_keep_three(root: Path) -> None:
    manager = CheckpointManager(root, keep=3)
    for step in range(1, 6):
        save(manager, step)
    assert steps_on_disk(root) == ["step-00000003", "step-00000004", "step-00000005"]


def test_prune_never_deletes_latest_or_the_newest_verified(root: Path) -> None:
    manager = CheckpointManager(root, keep=3)
    for step in (1, 2, 3):
        save(manager, step)
    truncate(root / "step-00000003")  # latest is damaged (say, by the filesystem) after its commit
    manager.keep = 1
    manager._prune()
    # keep=1 alone would leave only step 3; step 2 survives as the newest verified one
    assert steps_on_disk(root) == ["step-00000002", "step-00000003"]
    assert resumed(root) == root / "step-00000002"


def test_same_step_saved_again_replaces_the_old_folder(root: Path) -> None:
    manager = CheckpointManager(root, keep=2, verify="sha256")
    save(manager, 100)
    tmp = manager.begin(100)
    (tmp / "model_states.pt").write_bytes(b"new")
    final = manager.commit(tmp, FIELDS)
    assert [e.path for e in Manifest.from_json((final / MANIFEST_NAME).read_text()).files] == ["model_states.pt"]
    assert resumed(root) == final
    manager.begin(200)
    assert [n for n in temp_folders(root) if n.startswith(".trash-")] == []


# ----- what commit and begin refuse, and what begin cleans -----

def test_commit_refuses_foreign_folders_links_and_bad_fields(root: Path, tmp_path: Path) -> None:
    manager = CheckpointManager(root, keep=2)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    with pytest.raises(CheckpointError, match="not a temporary folder"):
        manager.commit(elsewhere, FIELDS)
    tmp = manager.begin(3)
    (tmp / "link.pt").symlink_to(elsewhere)
    with pytest.raises(CheckpointError, match=r"link\.pt is not a regular file"):
        manager.commit(tmp, FIELDS)
    tmp = manager.begin(3)
    (tmp / MANIFEST_NAME).write_text("{}")
    with pytest.raises(CheckpointError, match="reserved"):
        manager.commit(tmp, FIELDS)
    tmp = manager.begin(3)
    with pytest.raises(ValueError, match="differs from the folder's step 3"):
        manager.commit(tmp, {**FIELDS, "step": 4})
    with pytest.raises(ValueError, match="manifest_fields"):
        manager.commit(tmp, {**FIELDS, "colour": "red"})
    with pytest.raises(ValueError, match=r"manifest.dtype"):
        manager.commit(tmp, {**FIELDS, "dtype": "fp8"})
    assert not (root / LATEST_NAME).exists()


def test_begin_removes_only_our_stale_temporary_folders(root: Path, tmp_path: Path) -> None:
    manager = CheckpointManager(root, keep=2)
    stale = manager.begin(1)
    (stale / "shard.pt").write_bytes(b"x" * 100)
    trash = root / ".trash-step-00000001-99"
    trash.mkdir()
    outside = tmp_path / "precious"
    outside.mkdir()
    (outside / "keep.me").write_text("data")
    (root / ".tmp-step-00000009-4242").symlink_to(outside)  # a link with our name pattern: not followed
    (root / ".tmp-step-00000008-1").write_text("a file, not a folder")
    (root / ".tmp-notes").mkdir()  # not our pattern
    fresh = manager.begin(2)
    assert not stale.exists() and not trash.exists()
    assert (outside / "keep.me").read_text() == "data"
    assert (root / ".tmp-step-00000009-4242").is_symlink()
    assert (root / ".tmp-step-00000008-1").is_file() and (root / ".tmp-notes").is_dir()
    assert fresh.is_dir()


# ----- a real writer killed with SIGKILL -----

WRITER = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from hpc_train.checkpoint import CheckpointManager
    tmp = CheckpointManager(Path(sys.argv[1]), keep=3).begin(200)
    print(tmp, flush=True)
    block = b"w" * (1 << 20)
    for name in ("model_states.pt", "optim.pt"):
        with open(tmp / name, "wb") as handle:
            for _ in range(512):
                handle.write(block)
                handle.flush()
                time.sleep(0.005)
""")


@pytest.mark.slow
def test_sigkill_mid_write_keeps_the_previous_checkpoint(root: Path) -> None:
    good = save(CheckpointManager(root, keep=3, verify="sha256"), 100)
    child = subprocess.Popen([sys.executable, "-c", WRITER, str(root)], stdout=subprocess.PIPE, text=True)
    try:
        tmp = Path(child.stdout.readline().strip())  # type: ignore[union-attr]
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            shard = tmp / "model_states.pt"
            if shard.exists() and shard.stat().st_size >= 8 << 20:
                break
            time.sleep(0.01)
        else:
            pytest.fail("the writer did not get going")
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
        child.stdout.close()  # type: ignore[union-attr]
    assert child.returncode == -signal.SIGKILL
    assert tmp.is_dir() and tmp.name.endswith(f"-{child.pid}")
    assert latest_text(root) == "step-00000100"
    assert resumed(root) == good
    after = CheckpointManager(root, keep=3, verify="sha256")
    tmp2 = after.begin(200)
    assert not tmp.exists()
    write_files(tmp2, 200)
    assert after.commit(tmp2, FIELDS) == resumed(root) == root / "step-00000200"


# ----- the manifest format -----

def a_manifest() -> Manifest:
    return Manifest(step=3, created=1.5, files=[FileEntry("a/b.pt", 4, "0" * 64)], **FIELDS)


def test_manifest_json_round_trip() -> None:
    manifest = a_manifest()
    assert Manifest.from_json(manifest.to_json()) == manifest
    assert manifest.total_bytes == 4


@pytest.mark.parametrize(("files", "engine"), [
    (["state/mp_rank_00_model_states.pt", "ranks/ranks-0-1.pt"], "deepspeed"),
    (["dcp/__0_0.distcp", "dcp/.metadata", "ranks/ranks-0-1.pt"], "fsdp2"),
    (["ranks/rank-0.pt", "ranks/rank-1.pt", "dcp/__0_0.distcp"], "fsdp2"),  # the FSDP2 trainer's older layout
    (["ranks/rank-0.pt", "deepspeed/engine/state/mp_rank_00_model_states.pt"], "program"),
])
def test_a_manifest_from_before_the_engine_key_is_told_by_its_files(files: list[str], engine: str) -> None:
    data = a_manifest().to_dict()
    data.pop("engine", None)
    data["files"] = [{"path": path, "size": 1, "sha256": "0" * 64} for path in files]
    assert Manifest.from_json(json.dumps(data)).engine == engine


def test_the_engine_is_written_where_the_files_would_not_tell_it_and_read_back() -> None:
    for engine in ("deepspeed", "fsdp2", "program"):
        manifest = dataclasses.replace(a_manifest(), engine=engine)  # its one file, a/b.pt, says deepspeed
        assert json.loads(manifest.to_json()).get("engine") == (None if engine == "deepspeed" else engine)
        assert Manifest.from_json(manifest.to_json()).engine == engine
    # a DeepSpeed run's manifest has exactly the keys a version from before the engine reads
    keys = set(json.loads(a_manifest().to_json()))
    assert keys == {"format", "step", "world_size", "layout", "zero_stage", "dtype", "config_hash", "created",
                    "files"}


def mutate(change) -> str:
    data = a_manifest().to_dict()
    change(data)
    return json.dumps(data)


@pytest.mark.parametrize(("change", "field"), [
    (lambda d: d.update(extra=1), "unknown key(s) 'extra'"),
    (lambda d: d.pop("dtype"), "missing key(s) 'dtype'"),
    (lambda d: d.update(step="3"), "manifest.step"),
    (lambda d: d.update(step=True), "manifest.step"),
    (lambda d: d.update(step=-1), "manifest.step"),
    (lambda d: d.update(format=2), "manifest.format"),
    (lambda d: d.update(world_size=4), "manifest.layout"),
    (lambda d: d["layout"].update(expert=1), "manifest.layout"),
    (lambda d: d.update(zero_stage=4), "manifest.zero_stage"),
    (lambda d: d.update(engine="megatron"), "manifest.engine: must be one of deepspeed, fsdp2, program"),
    (lambda d: d.update(engine=None), "manifest.engine"),
    (lambda d: d.update(created=float("nan")), "manifest.created"),
    (lambda d: d.update(config_hash=""), "manifest.config_hash"),
    (lambda d: d.update(files={}), "manifest.files"),
    (lambda d: d["files"][0].update(size=-1), "manifest.files[0].size"),
    (lambda d: d["files"][0].update(sha256="ABC"), "manifest.files[0].sha256"),
    (lambda d: d["files"][0].update(mode=1), "manifest.files[0]"),
    (lambda d: d["files"].append(dict(d["files"][0])), "manifest.files[1].path"),
    (lambda d: d["files"][0].update(path="../x.pt"), "manifest.files[0].path"),
    (lambda d: d["files"][0].update(path="/etc/passwd"), "manifest.files[0].path"),
    (lambda d: d["files"][0].update(path="a/../../x"), "manifest.files[0].path"),
    (lambda d: d["files"][0].update(path="a//b"), "manifest.files[0].path"),
    (lambda d: d["files"][0].update(path="a\\..\\b"), "manifest.files[0].path"),
    (lambda d: d["files"][0].update(path=MANIFEST_NAME), "manifest.files[0].path"),
    (lambda d: d["files"][0].update(path=""), "manifest.files[0].path"),
])
def test_manifest_rejects(change, field: str) -> None:
    with pytest.raises(ValueError, match="manifest") as error:
        Manifest.from_json(mutate(change))
    assert field in str(error.value)


def test_manifest_rejects_non_objects() -> None:
    for text in ("[]", "3", "not json"):
        with pytest.raises(ValueError, match="manifest"):
            Manifest.from_json(text)


def test_sha256_reads_in_chunks(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_bytes(b"abc" * 1000)
    expected = (3000, hashlib.sha256(b"abc" * 1000).hexdigest())
    assert sha256_file(path, chunk=7) == sha256_file(path) == expected
    assert inspect_checkpoint(tmp_path / "nope")[1] is not None
