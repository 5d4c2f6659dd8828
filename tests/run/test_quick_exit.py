"""A finished rank leaves without the interpreter's teardown, its output flushed; a failure exits as usual."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO

SETUP = ("import atexit, logging, sys\nfrom hpc_train.run.quick_exit import exit_quickly_when_done\n"
         "logging.basicConfig(filename=sys.argv[1], level=logging.INFO)\n"
         "atexit.register(lambda: print(' teardown ran'))  # registered before: skipped\nexit_quickly_when_done()\n"
         "print('printed last', end='')\nlogging.info('logged last')\n")


def test_a_finished_rank_exits_0_with_its_output_and_logs_flushed(tmp_path: Path) -> None:
    log = tmp_path / "rank.log"
    code = SETUP
    result = subprocess.run([sys.executable, "-c", code, str(log)], cwd=REPO, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0 and result.stdout == "printed last"  # the earlier handler was skipped
    assert "logged last" in log.read_text()


def test_an_exception_at_the_top_exits_as_usual(tmp_path: Path) -> None:
    code = SETUP + "raise ValueError('after the rank finished')\n"
    result = subprocess.run([sys.executable, "-c", code, f"{tmp_path}/rank.log"], cwd=REPO, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 1 and "ValueError: after the rank finished" in result.stderr
