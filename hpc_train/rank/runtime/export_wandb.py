"""Weights & Biases from rank 0, one W&B run per hpc_train run, across every requeue.

Why the state file: a requeued attempt is a new process, and W&B would start a new run. ``wandb.json`` in the run
folder keeps the run id (``resume="allow"`` continues it) and the last step sent. An exact resume replays the steps
after the last checkpoint; W&B would either drop them (a step below its last) or, keyed on the trainer's step,
show them twice. So every value is logged against ``trainer/step`` (``define_metric(step_metric=...)``), and the
steps an earlier attempt already sent are not sent again: the exact resume reproduces them bit for bit, so the
chart is the one an uninterrupted run would draw.

A W&B failure (no package, no network, a full disk) never stops training: one warning, and the run goes on
without it. Offline runs go under ``RUN_DIR/wandb/`` for ``wandb sync`` from a login node.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from hpc_train.run.files import MAX_RECORD_FILE, atomic_write, open_record
from hpc_train.run.paths import WANDB_DIR, WANDB_STATE_FILE

__all__ = ["STATE_FILE", "STEP_METRIC", "WandbExporter"]

STATE_FILE = WANDB_STATE_FILE
STEP_METRIC = "trainer/step"
_SAVE_EVERY_S = 30.0  # the last step sent is rewritten at most this often (and at close)
_SERVICE_WAIT_S = 300.0  # W&B's service starts slowly on a busy shared file system; its default is 30 s


def _read_state(path: Path) -> dict[str, Any]:
    try:
        with open_record(path) as handle:
            data = json.loads(handle.read(MAX_RECORD_FILE))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _drop_links(folder: Path) -> None:
    """W&B links each offline run's ``logs/debug-core.log`` to its cache in the home folder: a run folder holds no
    link to elsewhere (the logs are still in W&B's cache)."""
    for parent, folders, files in os.walk(folder):
        for name in (*folders, *files):
            path = Path(parent) / name
            if path.is_symlink():
                with contextlib.suppress(OSError):
                    path.unlink()


class WandbExporter:
    """Sends rank 0's metrics.jsonl records to one W&B run; see the module note for why it skips replayed steps."""

    def __init__(self, run_dir: Path, mode: str, project: str, entity: str, name: str, config: Mapping[str, Any],
                 log: Callable[[str], None]) -> None:
        self.run_dir, self.log = Path(run_dir), log
        self.state_path = self.run_dir / STATE_FILE
        state = _read_state(self.state_path)
        run_id = state.get("id")
        if not (isinstance(run_id, str) and run_id.isalnum() and len(run_id) <= 64):
            run_id = secrets.token_hex(4)
        sent = state.get("last_step")
        self.id = run_id
        self.sent_before = sent if isinstance(sent, int) and not isinstance(sent, bool) else 0
        self.last_step = self.sent_before
        self._saved = 0.0
        self.run: Any = None
        try:
            import wandb

            self._save()  # the id first: an attempt that dies in wandb.init still leaves it for the next
            self.run = wandb.init(
                project=project, entity=entity or None, id=run_id, resume="allow", mode=mode, dir=str(self.run_dir),
                name=name, config=dict(config),
                settings=wandb.Settings(init_timeout=_SERVICE_WAIT_S, x_service_wait=_SERVICE_WAIT_S, console="off",
                                        disable_git=True, save_code=False, symlink=False, silent=True))
            self.run.define_metric(STEP_METRIC)
            self.run.define_metric("*", step_metric=STEP_METRIC)
        except ImportError:
            self._fail("the wandb package is missing (pip install 'hpc_train[wandb]')")
        except Exception as error:  # W&B must never stop training: any failure is one warning
            self._fail(f"{type(error).__name__}: {error}")
        else:
            resumed = f", continuing from step {self.sent_before}" if self.sent_before else ""
            self.log(f"wandb: run {run_id} ({mode}{resumed})")

    def record(self, record: Mapping[str, Any]) -> None:
        """A metrics.jsonl record; steps an earlier attempt sent are skipped (the module note says why)."""
        step = record.get("step")
        if self.run is None or not isinstance(step, int) or step <= self.sent_before:
            return
        values = {key: value for key, value in record.items()
                  if key not in ("step", "time") and isinstance(value, int | float) and not isinstance(value, bool)}
        try:
            self.run.log({**values, STEP_METRIC: step})
        except Exception as error:
            self._fail(f"{type(error).__name__}: {error}")
            return
        self.last_step = max(self.last_step, step)
        if time.monotonic() - self._saved > _SAVE_EVERY_S:
            self._save()

    def close(self) -> None:
        """Finish the W&B run (its offline record complete) and keep the last step sent."""
        if self.run is None:
            return
        run, self.run = self.run, None
        try:
            run.finish()
        except Exception as error:
            self.log(f"warning: wandb: finishing the run failed ({type(error).__name__}: {error})")
        self._save()
        _drop_links(self.run_dir / WANDB_DIR)

    def _save(self) -> None:
        try:
            atomic_write(self.state_path, json.dumps({"id": self.id, "last_step": self.last_step}) + "\n")
        except OSError as error:
            self.log(f"warning: wandb: cannot keep {self.state_path.name} ({error.strerror or error}); a requeued "
                     "attempt will start a new W&B run")
        self._saved = time.monotonic()

    def _fail(self, why: str) -> None:
        run, self.run = self.run, None
        if run is not None:
            with contextlib.suppress(Exception):  # already failing: the warning below says it
                run.finish(exit_code=1)
        self.log(f"warning: wandb: {why}; training goes on without W&B")
