"""The /proc reader against real processes: a child that starts a grandchild, both found below this process
with their environment and command line; a process that is gone reads as None, not an error."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from hpc_train.run.procs import command_line, descendants, environment, processes


def test_a_child_and_its_grandchild_are_found_below_us_with_their_environment() -> None:
    script = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(30)']); " \
             "time.sleep(30)"
    child = subprocess.Popen([sys.executable, "-c", script], env={**os.environ, "HPC_TRAIN_PROCS_TEST": "tree"})
    try:
        deadline = time.monotonic() + 20
        while not (below := descendants(child.pid)) and time.monotonic() < deadline:
            time.sleep(0.05)
        (grandchild,) = below
        assert child.pid in descendants(os.getpid()) and grandchild in descendants(os.getpid())
        for pid in (child.pid, grandchild):
            assert (environment(pid) or {}).get(b"HPC_TRAIN_PROCS_TEST") == b"tree"
        assert b"time.sleep(30)" in (command_line(grandchild) or b"")
        mine = {process.pid: process for process in processes()}
        assert mine[child.pid].parent == os.getpid() and mine[grandchild].parent == child.pid
        assert mine[child.pid].alive and mine[grandchild].start >= mine[child.pid].start
        # a subtree left out (an agent's standby and what it started), and zombies left out where asked
        assert child.pid not in descendants(os.getpid(), skip={child.pid})
        assert grandchild not in descendants(os.getpid(), skip={child.pid})
        os.kill(grandchild, 9)
        deadline = time.monotonic() + 20
        while grandchild in descendants(child.pid, alive=True) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert grandchild in descendants(child.pid) and grandchild not in descendants(child.pid, alive=True)
    finally:
        for pid in [*descendants(child.pid), child.pid]:  # this test's processes only, not the worker's others
            os.kill(pid, 9)
        child.wait()
    assert environment(child.pid) is None and command_line(child.pid) is None  # reaped: gone


def test_a_node_s_cpus_are_shared_in_consecutive_blocks_one_per_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    from hpc_train.run.procs import cpu_shares

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {8, 9, 10, 11, 12, 13, 14, 15})  # the step's CPUs
    assert cpu_shares(2) == [{8, 9, 10, 11}, {12, 13, 14, 15}]
    assert cpu_shares(3) == [{8, 9}, {10, 11}, {12, 13}]  # the 2 left over are not given twice
    assert cpu_shares(1) == [] and cpu_shares(9) == []  # one rank keeps the step's; too few CPUs: no binding


TIED = "import os, sys, time; from hpc_train.run.procs import tie_to_parent; " \
       "print(tie_to_parent(int(sys.argv[1])), flush=True); time.sleep(60)"


def test_a_process_tied_to_its_parent_dies_with_it() -> None:
    """The parent starts the tied child and is then killed: the child goes too (PR_SET_PDEATHSIG)."""
    parent = subprocess.Popen([sys.executable, "-c", "import os, subprocess, sys, time; "
                               f"subprocess.Popen([sys.executable, '-c', {TIED!r}, str(os.getpid())]); "
                               "time.sleep(60)"], stdout=subprocess.PIPE, text=True, cwd=os.getcwd())
    try:
        assert parent.stdout is not None and parent.stdout.readline().strip() == "True"
        (child,) = descendants(parent.pid)
    finally:
        parent.kill()
        parent.wait()
    deadline = time.monotonic() + 30
    while command_line(child) is not None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert command_line(child) is None, "the tied child outlived its parent"


def test_a_parent_gone_before_the_tie_is_said() -> None:
    """A rank that was still importing when its controller ended is told so, not left waiting for a signal that
    will never come."""
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    tied = subprocess.run([sys.executable, "-c", TIED.replace("time.sleep(60)", "pass"), str(gone.pid)],
                          capture_output=True, text=True, timeout=60, check=True)
    assert tied.stdout.strip() == "False"
