"""The one writer of outputs (``--out``): what it refuses before anything is written, and how it writes.

Why: ``plot --out`` naming a FIFO hung the command, a device or a link took the bytes meant for a file, and
``render --out`` into a folder it could not write made the run folder first. Each refusal here is one message
naming the path and the fix; each write is all of the file or nothing, and never goes through a link.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from hpc_train.errors import ConfigError
from hpc_train.run.outputs import check_output, open_output, write_output


def _refusal(path: Path, **options: object) -> str:
    with pytest.raises(ConfigError) as caught:
        check_output(path, **options)  # type: ignore[arg-type]
    return str(caught.value)


def test_a_new_name_in_an_existing_folder_and_a_regular_file_are_taken(tmp_path: Path) -> None:
    assert check_output(tmp_path / "new.png") == tmp_path / "new.png"
    (tmp_path / "old.png").write_bytes(b"x")
    assert check_output(tmp_path / "old.png") == tmp_path / "old.png"


@pytest.mark.parametrize(("make", "says"), [
    (lambda p: os.mkfifo(p), "is a named pipe (FIFO)"),
    (lambda p: p.mkdir(), "is a folder"),
    (lambda p: p.symlink_to(p.parent / "elsewhere"), "is a symbolic link"),
    (lambda p: p.symlink_to("/etc/passwd"), "is a symbolic link"),
])
def test_what_is_not_a_regular_file_is_refused_with_the_path_and_the_fix(tmp_path: Path, make: object,
                                                                        says: str) -> None:
    path = tmp_path / "out.svg"
    make(path)  # type: ignore[operator]
    message = _refusal(path, example="plot.svg")
    assert message.startswith(f"--out: {path} {says}") and "Fix: name a regular file" in message
    assert "plot.svg" in message


def test_a_device_and_a_missing_folder_are_refused(tmp_path: Path) -> None:
    assert "/dev/null is a device" in _refusal(Path("/dev/null"))
    message = _refusal(tmp_path / "no" / "such" / "out.json")
    assert f"the folder {tmp_path / 'no' / 'such'} does not exist" in message and "mkdir -p" in message
    (tmp_path / "file").write_text("x")
    assert "cannot be used" in _refusal(tmp_path / "file" / "out.json")


def test_an_existing_file_without_replace_and_folders_for_folder_outputs(tmp_path: Path) -> None:
    (tmp_path / "model.pt").write_bytes(b"x")
    assert "already exists" in _refusal(tmp_path / "model.pt", replace=False) and "--force" in \
        _refusal(tmp_path / "model.pt", replace=False)
    (tmp_path / "hf").mkdir()
    assert check_output(tmp_path / "hf", folder=True) == tmp_path / "hf"
    assert "is a file" in _refusal(tmp_path / "model.pt", folder=True)
    (tmp_path / "link").symlink_to(tmp_path / "hf")
    assert "is a symbolic link" in _refusal(tmp_path / "link", folder=True)


def test_the_option_named_is_the_one_given() -> None:
    assert _refusal(Path("/dev/zero"), option="--report").startswith("--report: /dev/zero is a device")


def test_write_output_is_atomic_leaves_no_temporary_file_and_sets_the_mode(tmp_path: Path) -> None:
    out = tmp_path / "report.json"
    write_output(out, "{}\n", mode=0o640)
    assert out.read_text() == "{}\n" and stat.S_IMODE(out.stat().st_mode) == 0o640
    write_output(out, b"[]\n")
    assert out.read_bytes() == b"[]\n" and sorted(p.name for p in tmp_path.iterdir()) == ["report.json"]


def test_a_failed_write_leaves_the_old_file_and_no_temporary_file(tmp_path: Path) -> None:
    out = tmp_path / "plot.png"
    out.write_bytes(b"old")
    with pytest.raises(RuntimeError), open_output(out) as handle:
        handle.write(b"half")
        raise RuntimeError("the drawing failed")
    assert out.read_bytes() == b"old" and sorted(p.name for p in tmp_path.iterdir()) == ["plot.png"]


def test_a_link_planted_after_the_check_is_replaced_never_followed(tmp_path: Path) -> None:
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    out = tmp_path / "out.json"
    check_output(out)
    out.symlink_to(victim)  # planted between the check and the write
    write_output(out, "new")
    assert victim.read_text() == "precious" and not out.is_symlink() and out.read_text() == "new"


def test_a_long_name_still_gets_a_temporary_file_the_folder_takes(tmp_path: Path) -> None:
    out = tmp_path / ("x" * 250 + ".png")
    write_output(out, b"png")
    assert out.read_bytes() == b"png"


def test_an_output_follows_the_umask_and_a_replaced_file_keeps_its_mode(tmp_path: Path) -> None:
    """Found by review: outputs were made 0644 whatever the umask, and a 0600 file replaced became 0644."""
    import os
    import stat

    from hpc_train.run.outputs import write_output

    old = os.umask(0o077)
    try:
        write_output(tmp_path / "new.svg", "x")
        kept = tmp_path / "kept.json"
        kept.write_text("old")
        kept.chmod(0o640)
        write_output(kept, "new")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "new.svg").stat().st_mode) == 0o600
    assert stat.S_IMODE(kept.stat().st_mode) == 0o640 and kept.read_text() == "new"
