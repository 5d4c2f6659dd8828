"""The monitor's TensorBoard events: one event for all the scalars of a step, read back as each tag's points."""

from __future__ import annotations

from pathlib import Path

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

from hpc_train.rank.runtime.tensorboard_events import TENSORBOARD_DIR, open_writer, write_scalars


def _events(run_dir: Path) -> list:
    (path,) = (run_dir / TENSORBOARD_DIR).glob("events.out.tfevents.*")
    return [event for event in EventFileLoader(str(path)).Load() if event.HasField("summary")]


def test_a_step_s_scalars_are_one_event_and_each_tag_reads_back_its_points(tmp_path: Path) -> None:
    """30 scalars a logged step were 30 events (1.3 ms of rank 0's CPU); now one. A value of None is left out."""
    writer = open_writer(tmp_path, start_step=0)
    for step in (1, 2, 3):
        write_scalars(writer, {"train/loss": 10.0 - step, "perf/mfu": None,
                               **{f"breakdown/phase{i}_ms": float(step * i) for i in range(30)}}, step)
    write_scalars(writer, {"perf/mfu": None}, 4)  # nothing to write: no event
    writer.close()

    events = _events(tmp_path)
    assert [event.step for event in events] == [1, 2, 3]
    assert [len(event.summary.value) for event in events] == [31, 31, 31]
    accumulator = EventAccumulator(str(tmp_path / TENSORBOARD_DIR), size_guidance={"scalars": 0})
    accumulator.Reload()
    assert "perf/mfu" not in accumulator.Tags()["scalars"]
    assert [(e.step, e.value) for e in accumulator.Scalars("train/loss")] == [(1, 9.0), (2, 8.0), (3, 7.0)]
    assert [e.value for e in accumulator.Scalars("breakdown/phase7_ms")] == [7.0, 14.0, 21.0]

