"""``ckpt ls / verify / export`` against corrupt, hostile and strange checkpoint folders.

Why: the manifest decides which files a resume opens (and export unpickles), so a manifest naming ../../x or an
absolute path, a shard that is a link out of the folder, a FIFO where a file should be, or nesting that exhausts
the stack must each end in one message (verify: exit 1, none usable; export: exit 2) without a traceback, a hang
or a byte read or written outside. ``ls`` lists what is there (exit 0) and names the problem. A step folder named
with non-ASCII digits is not a step; file names read from disk reach the terminal without raw escape bytes.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.security.harness import Case, Outcome, World, cases_ids, command, run_case

WEIGHTS = b"pretend these are weights\n"
Mutate = Callable[[World, Path], None]


def _manifest(number: int, shards: dict[str, bytes], **changes: object) -> dict[str, object]:
    listed = [{"path": name, "size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
              for name, data in shards.items()]
    return {"format": 1, "step": number, "world_size": 1,
            "layout": {"tensor": 1, "pipeline": 1, "data": 1, "context": 1},
            "zero_stage": 0, "dtype": "fp32", "config_hash": "abc", "created": 1700000000.0, "files": listed, **changes}


def _step(world: World, name: str, step: int, **changes: object) -> Path:
    folder = world.run_dir / "checkpoints" / name
    folder.mkdir(mode=0o700)
    (folder / "model.pt").write_bytes(WEIGHTS)
    manifest = _manifest(step, {"model.pt": WEIGHTS}, **changes)
    (folder / "manifest.json").write_text(json.dumps(manifest), encoding="utf-8")
    return folder


def _run(mutate: Mutate | None = None):
    """A run folder with one good checkpoint (step 10, named by latest), then ``mutate(world, step_folder)``."""

    def setup(world: World) -> None:
        world.run_dir.mkdir(mode=0o700)
        (world.run_dir / "plan.json").write_text('{"name": "hpc-train", "executor": "local"}', encoding="utf-8")
        (world.run_dir / "checkpoints").mkdir(mode=0o700)
        folder = _step(world, "step-00000010", 10)
        (world.run_dir / "checkpoints" / "latest").write_text("step-00000010\n", encoding="utf-8")
        if mutate is not None:
            mutate(world, folder)
    return setup


def _manifest_text(text: str) -> Mutate:
    return lambda world, folder: (folder / "manifest.json").write_text(world.sub(text), encoding="utf-8")


def _manifest_fields(**changes: object) -> Mutate:
    return lambda world, folder: (folder / "manifest.json").write_text(
        world.sub(json.dumps(_manifest(10, {"model.pt": WEIGHTS}, **changes))), encoding="utf-8")


def _listing(path: str, data: bytes) -> Mutate:
    """The manifest lists ``path`` (filled in by World.sub) with the size and sha256 of ``data``."""
    entry = {"path": path, "size": len(data), "sha256": hashlib.sha256(data).hexdigest()}

    def mutate(world: World, folder: Path) -> None:
        manifest = _manifest(10, {"model.pt": WEIGHTS})
        manifest["files"] = [*manifest["files"], {**entry, "path": world.sub(path)}]  # type: ignore[list-item]
        (folder / "manifest.json").write_text(json.dumps(manifest), encoding="utf-8")  # type: ignore[operator]
    return mutate


def _replace(name: str, how: str) -> Mutate:
    """Put a FIFO, a link out, a dangling link, a folder or a file where ``name`` (below checkpoints/) is."""

    def mutate(world: World, folder: Path) -> None:
        path = world.run_dir / "checkpoints" / name
        if path.is_dir() and not path.is_symlink():
            for child in sorted(path.rglob("*"), reverse=True):
                child.rmdir() if child.is_dir() else child.unlink()
            path.rmdir()
        elif path.exists() or path.is_symlink():
            path.unlink()
        {"fifo": lambda: os.mkfifo(path), "link-out": lambda: os.symlink(world.victim_file, path),
         "link-folder-out": lambda: os.symlink(world.victim, path),
         "dangling": lambda: os.symlink(world.root / "nowhere", path), "folder": lambda: path.mkdir(),
         "file": lambda: path.write_bytes(WEIGHTS)}[how]()
    return mutate


VERBS = {"ls": (0,), "verify": (1, 2), "export": (1, 2)}
BROKEN = [("truncated", _manifest_text('{"format": 1, "step": 10, "files": [')),
          ("not-an-object", _manifest_text("[]")), ("wrong-types", _manifest_fields(step="10", world_size="one")),
          ("traversal-path", _listing("../../../victim/precious.txt", b"the bytes a planted link must never change\n")),
          ("absolute-path", _listing("@VICTIM@/precious.txt", b"the bytes a planted link must never change\n")),
          ("deep-nesting", _manifest_text("[" * 100_000 + "]" * 100_000)),
          ("deep-object", _manifest_text('{"a":' * 100_000 + "1" + "}" * 100_000)),
          ("nan-created", _manifest_text(json.dumps(_manifest(10, {"model.pt": WEIGHTS})).replace("1700000000.0",
                                                                                                 "NaN"))),
          ("huge-size", _manifest_fields(files=[{"path": "model.pt", "size": 2**70, "sha256": "0" * 64}])),
          ("shard-link-out", _replace("step-00000010/model.pt", "link-out")),
          ("shard-dangling", _replace("step-00000010/model.pt", "dangling")),
          ("shard-is-folder", _replace("step-00000010/model.pt", "folder")),
          ("manifest-is-folder", _replace("step-00000010/manifest.json", "folder")),
          ("manifest-link-out", _replace("step-00000010/manifest.json", "link-out")),
          ("binary-manifest", lambda world, folder: (folder / "manifest.json").write_bytes(b"\xff\xfe\x00{"))]
BLOCKING = [("manifest-fifo", "step-00000010/manifest.json"), ("shard-fifo", "step-00000010/model.pt"),
            ("latest-fifo", "latest")]


def _verb(verb: str, case_id: str, setup: Callable[[World], None], *extra: str, **fields: object) -> Case:
    argv = ["ckpt", verb, "@RUN@", *extra]
    if verb == "export":
        argv += ["--out", "@ROOT@/out.pt"]
    fields.setdefault("expect", VERBS[verb])
    return command(case_id, *argv, setup=setup, allowed=("out.pt",), **fields)


def _broken_cases() -> list[Case]:
    cases = []
    for label, mutate in BROKEN:
        for verb in VERBS:
            cases.append(_verb(verb, f"ckpt-{label}-{verb}", _run(mutate)))
        cases.append(_verb("verify", f"ckpt-{label}-verify-sha256", _run(mutate), "--sha256"))
    for label, name in BLOCKING:
        for verb in ("ls", "verify"):
            cases.append(_verb(verb, f"ckpt-{label}-{verb}", _run(_replace(name, "fifo")), "--sha256",
                               isolated=True, expect=(0, 1, 2)))
    return cases


def _no_step(name: str):
    def check(world: World, outcome: Outcome) -> None:
        listed = [row["folder"] for row in json.loads(outcome.out)["checkpoints"]]
        assert name not in listed and listed == ["step-00000010"], f"ckpt ls lists {listed}"
    return check


def _strange_step(name: str) -> Mutate:
    return lambda world, folder: _step(world, name, 20)


def _odd_cases() -> list[Case]:
    good = _run()
    cases = [_verb("ls", "ckpt-good-ls", good), _verb("verify", "ckpt-good-verify", good, "--sha256", expect=0)]
    for label, name in (("arabic-indic", "step-٠٠٠٠٠٠٢٠"), ("fullwidth", "step-００００００２０"),
                        ("short-arabic", "step-٠٠١"), ("superscript", "step-⁰⁰⁰⁰⁰⁰²⁰")):
        cases.append(_verb("ls", f"ckpt-step-{label}", _run(_strange_step(name)), "--json", check=_no_step(name)))
    for label, name, how in (("step-fifo", "step-00000020", "fifo"), ("step-dangling", "step-00000020", "dangling"),
                             ("step-is-file", "step-00000020", "file"),
                             ("step-link-out", "step-00000020", "link-folder-out"),
                             ("latest-link-out", "latest", "link-out"), ("latest-dangling", "latest", "dangling")):
        cases.append(_verb("ls", f"ckpt-{label}", _run(_replace(name, how)), "--json", isolated=how == "fifo",
                           check=_no_step(name) if name != "latest" else None))
    esc = "a\x1b]0;pwned\x07\x1b[2J\x9b31m.pt"
    cases += [
        _verb("ls", "ckpt-listed-path-esc", _run(_listing(esc, WEIGHTS)), no_escapes=True),
        _verb("verify", "ckpt-listed-path-esc-verify", _run(_listing(esc, WEIGHTS)), no_escapes=True),
        _verb("ls", "ckpt-unlisted-file-esc", _run(lambda w, f: (f / esc).write_bytes(b"x")), no_escapes=True),
        _verb("verify", "ckpt-unlisted-file-markup", _run(lambda w, f: (f / "[bold]x").write_bytes(b"x"))),
        _verb("ls", "ckpt-latest-esc", _run(lambda w, f: (f.parent / "latest").write_text(esc)), no_escapes=True),
        _verb("ls", "ckpt-checkpoints-link-out", _run(_replace("", "link-folder-out")), expect=2),
        _verb("ls", "ckpt-checkpoints-0777", _run(lambda w, f: f.parent.chmod(0o777)), expect=2),
        _verb("ls", "ckpt-checkpoints-is-file", _run(_replace("", "file")), expect=2),
        _export_onto_victim(),
        command("ckpt-ls-missing", "ckpt", "ls", "@ROOT@/nope"),
        command("ckpt-ls-a-file", "ckpt", "ls", "@VICTIM@/precious.txt"),
        command("ckpt-ls-not-a-run", "ckpt", "ls", "@VICTIM@"),
        command("ckpt-ls-tmp-step", "ckpt", "ls", "@RUN@/checkpoints/.tmp-step-00000020-1", setup=_tmp_step),
        command("ckpt-export-out-folder", "ckpt", "export", "@RUN@", "--out", "@VICTIM@", setup=good),
    ]
    return cases


def _tmp_step(world: World) -> None:
    _run()(world)
    (world.run_dir / "checkpoints" / ".tmp-step-00000020-1").mkdir()


def _export_onto_victim() -> Case:
    return command("ckpt-export-out-exists", "ckpt", "export", "@RUN@", "--out", "@VICTIM@/precious.txt",
                   setup=_run(), says=("--out",))


CASES = [*_broken_cases(), *_odd_cases()]


@pytest.mark.parametrize("case", CASES, ids=cases_ids(CASES))
def test_checkpoint_folders(case: Case, world: World) -> None:
    run_case(case, world)
