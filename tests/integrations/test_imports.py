"""The integrations import without torch or the library (a login node, a linter), build the library's own class
on first use, and do nothing outside a run hpc_train started (the same script under plain torchrun)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import REPO


def test_importing_the_integrations_imports_neither_torch_nor_the_libraries() -> None:
    code = ("import sys\nimport hpc_train.integrations.lightning, hpc_train.integrations.transformers\n"
            "import hpc_train.integrations.accelerate\n"
            "heavy = [m for m in ('torch', 'pytorch_lightning', 'lightning', 'transformers', 'accelerate') "
            "if m in sys.modules]\nprint(heavy)")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60,
                            check=True)
    assert result.stdout.strip() == "[]"


def test_each_callback_is_the_library_s_own_kind_and_idle_outside_hpc_train() -> None:
    import pytorch_lightning as pl
    from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

    from hpc_train.integrations import lightning, transformers

    callback = lightning.HpcTrainCallback()
    assert isinstance(callback, pl.Callback) and lightning.HpcTrainCallback is type(callback)
    callback.setup(None, None, "fit")  # no hpc_train session here: nothing joins, nothing stops
    callback.on_train_batch_end(None, None, None, None, 0)
    assert callback.stopped_at is None
    hf = transformers.HpcTrainCallback()
    assert isinstance(hf, TrainerCallback)
    state, control = TrainerState(), TrainerControl()
    hf.on_train_begin(TrainingArguments(output_dir="unused", report_to=[]), state, control)
    hf.on_step_end(None, state, control)
    hf.on_log(None, state, control, logs={"loss": 1.0})
    assert not control.should_save and not control.should_training_stop
    with pytest.raises(AttributeError, match="has no attribute 'Callback'"):
        _ = lightning.Callback


def test_the_lightning_stop_waits_past_an_epoch_s_last_batch() -> None:
    """A Lightning checkpoint at an epoch's last batch resumes a StatefulDataLoader into the wrong epoch, so the
    callback stops one step later there (tests/integrations/test_preemption_slurm.py's runs stop at random)."""
    from types import SimpleNamespace

    from hpc_train.integrations.lightning import ends_epoch

    def trainer(last: bool, batches: object = float("inf")) -> object:
        progress = SimpleNamespace(is_last_batch=last)
        return SimpleNamespace(fit_loop=SimpleNamespace(epoch_loop=SimpleNamespace(batch_progress=progress)),
                               num_training_batches=batches)

    assert ends_epoch(trainer(True), 3)
    assert not ends_epoch(trainer(False), 3)
    assert ends_epoch(trainer(False, 16), 15) and not ends_epoch(trainer(False, 16), 14)
    assert not ends_epoch(SimpleNamespace(), 0)  # a trainer without these: never defer
