"""The names inside ``checkpoints/``, defined once: what the manager writes is what status and export read."""

from __future__ import annotations

from pathlib import Path

from hpc_train.checkpoint.names import LATEST_NAME, STEP_FOLDER, TMP_FOLDER, TRASH_FOLDER, step_folder_name, step_of
from hpc_train.login.ops.status_files import checkpoint_state
from hpc_train.run.paths import CHECKPOINTS_DIR


def test_a_step_folder_name_reads_back_as_its_step_and_nothing_else_does() -> None:
    assert step_folder_name(100) == "step-00000100" and step_of("step-00000100") == 100
    assert step_of(step_folder_name(123456789012)) == 123456789012
    for other in ("step-5", "step-00000100.bak", ".tmp-step-00000100-42", "latest", "step-" + "9" * 31, ""):
        assert step_of(other) is None, other
    assert TMP_FOLDER.match(".tmp-step-00000100-42") and TRASH_FOLDER.match(".trash-step-00000100-42")
    assert not STEP_FOLDER.match(".tmp-step-00000100-42")


def test_status_reads_latest_as_the_manager_names_it(tmp_path: Path) -> None:
    folder = tmp_path / CHECKPOINTS_DIR
    folder.mkdir()
    (folder / LATEST_NAME).write_text(step_folder_name(40) + "\n")
    state = checkpoint_state(tmp_path)
    assert state is not None and (state.name, state.step) == ("step-00000040", 40)
    (folder / LATEST_NAME).write_text("step-40\n")  # not a name the manager writes
    state = checkpoint_state(tmp_path)
    assert state is not None and state.step is None
