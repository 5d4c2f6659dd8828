"""tests/strace_ops.py, the tool the run-folder tests count metadata operations with: a trace ends, and the
traced processes run on, even where strace cannot detach by itself."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.strace_ops import StraceUnavailableError, ensure_strace, trace_folder_ops

# Opens a file in the folder from a thread while the main thread starts processes one after the other, as an agent
# does when it restarts ranks: Python's subprocess starts them with vfork, and strace's detach waits forever for a
# parent held in vfork by a child that strace holds stopped. Each round adds a byte to the file ``beats``.
SPAWNER = """
import subprocess, sys, threading
from pathlib import Path
folder = Path(sys.argv[1])
def beat():
    while True:
        with open(folder / "beats", "ab") as beats:
            beats.write(b".")
threading.Thread(target=beat, daemon=True).start()
while True:
    subprocess.run(["/bin/true"], check=True)
"""


def _beats(folder: Path) -> int:
    try:
        return (folder / "beats").stat().st_size
    except FileNotFoundError:
        return 0


def test_a_trace_of_a_process_starting_processes_ends_and_the_process_runs_on(tmp_path: Path) -> None:
    try:
        ensure_strace()
    except StraceUnavailableError as why:  # as the run-folder tests: not installable, or no ptrace
        pytest.skip(str(why))
    folder = tmp_path / "run"
    folder.mkdir()
    spawner = subprocess.Popen([sys.executable, "-c", SPAWNER, str(folder)])
    try:
        deadline = time.monotonic() + 30
        while _beats(folder) == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        for _ in range(4):  # strace hangs on about a third of the detaches of such a process
            started = time.monotonic()
            ops = trace_folder_ops([spawner.pid], folder, 1.0, detach_s=3.0)
            assert time.monotonic() - started < 30
            assert ops.by_path["beats"] > 0, ops.describe()
            assert ops.seconds < 3.0  # the window (1 s), not the wait for strace to end
        before = _beats(folder)
        deadline = time.monotonic() + 30
        while _beats(folder) <= before and time.monotonic() < deadline:
            time.sleep(0.05)
        assert spawner.poll() is None and _beats(folder) > before, "the traced process stopped running"
    finally:
        spawner.kill()
        spawner.wait()
