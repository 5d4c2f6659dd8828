"""Rank 0's TensorBoard events file: opened once, and one event for all the scalars of a logged step.

Why one event a step: ``SummaryWriter.add_scalar`` makes an event per scalar (a protobuf, a queue put, a record
for the writer thread). A logged step of the trainer has about 30 scalars (loss, rate, throughput, and the
step-time breakdown's times, shares and spreads): 1.3 ms of rank 0's CPU on a 2-core Xeon, which the other ranks
wait out in the next collective. The same scalars as the values of one ``Summary`` are one event: 0.15-0.25 ms.
TensorBoard reads each value of an event as its tag's point at the event's step, as it does for one.

Why the events file is opened once: without TensorFlow, tensorboard's file layer opens it again for each record
(46 opens a second at 3 logged steps a second), each a call to a shared file system's metadata server. The writer
appends to one open file instead (:func:`_events_kept_open`), which its thread flushes every
:data:`TENSORBOARD_FLUSH_S` seconds, as do the monitor's close and a quick exit.

``torch.utils.tensorboard`` (and the ``tensorboard`` package it needs) is imported only when a writer is opened.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = ["TENSORBOARD_DIR", "TENSORBOARD_FLUSH_S", "open_writer", "write_scalars"]

TENSORBOARD_DIR = "tensorboard"
TENSORBOARD_FLUSH_S = 30  # the events file reaches the disk this often (and at close): a write, never an open


def open_writer(run_dir: Path, start_step: int) -> Any:
    """A ``SummaryWriter`` in ``run_dir``'s :data:`TENSORBOARD_DIR` whose readers drop the events after
    ``start_step`` (a resumed run trains those steps again). ImportError without the tensorboard package."""
    from torch.utils.tensorboard import SummaryWriter  # optional and heavy: only when asked for

    writer = SummaryWriter(log_dir=str(run_dir / TENSORBOARD_DIR), purge_step=start_step + 1,
                           flush_secs=TENSORBOARD_FLUSH_S)
    _events_kept_open(writer)
    return writer


def write_scalars(writer: Any, values: Mapping[str, float | None], step: int) -> None:
    """Every number of ``values`` (tag to value; None is left out) at ``step``, as one event."""
    from tensorboard.compat.proto.summary_pb2 import Summary

    summary = Summary(value=[Summary.Value(tag=tag, simple_value=float(value)) for tag, value in values.items()
                             if value is not None])
    if summary.value:
        writer._get_file_writer().add_summary(summary, step, time.time())


def _events_kept_open(writer: Any) -> None:
    """Point ``writer``'s (a ``SummaryWriter``'s) record stream at its events file opened once for appending,
    instead of tensorboard's file layer, which opens the file again for each record it appends (module note).
    Reaches into tensorboard's ``EventFileWriter`` (tensorboard 2.x); a writer built otherwise is left as it is."""
    try:
        events = writer._get_file_writer().event_writer
        records = events._async_writer._writer  # the RecordWriter its thread writes through
        path, old = events._file_name, records._writer
    except AttributeError:
        return
    events.flush()  # the header and the purge events go out through the old file first; the queue is empty now
    records._writer = open(path, "ab")  # noqa: SIM115 - the RecordWriter closes it with the writer
    old.close()
