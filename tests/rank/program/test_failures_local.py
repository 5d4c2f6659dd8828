"""A user program that fails on the ranks: one clear line in the follower's output and in ``logs``, the job
ends as a user failure and is not requeued. Each case is a real 2-rank run on submitit's local executor."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from hpc_train.config.program import Program
from hpc_train.rank.program.runner import UserCodeError, load_function
from tests.rank.program.test_runner_local import attempts, submit

pytestmark = pytest.mark.slow

CASES = {
    "import-error": ("code.py:main", "import nosuchmodule_xyz\ndef main(ctx):\n    pass\n",
                     "importing {tmp}/code.py failed: ModuleNotFoundError: No module named 'nosuchmodule_xyz'"),
    "script-exit": ("code.py", "import sys\nsys.exit(3)\n", "script {tmp}/code.py exited with status 3"),
    "rank-1-raises": ("code.py:main", "def main(ctx):\n    ctx.log(1, loss=1.0)\n    if ctx.rank == 1:\n"
                      "        raise ValueError('bad shard 7')\n    import torch.distributed as dist\n"
                      "    dist.barrier()\n", "ValueError('bad shard 7')"),
}


@pytest.mark.parametrize(("code", "says"), [
    ("def mian(ctx):\n    pass\n", "{tmp}/code.py has no function main (it has: mian)"),
    ("def main():\n    pass\n", "main() does not take the run context: define it as def main(ctx)"),
    ("main = 3\n", "{tmp}/code.py has no function main"),
])
def test_a_function_that_cannot_be_called_is_named_before_anything_starts(tmp_path: Path, code: str,
                                                                          says: str) -> None:
    """What the ranks check before the bootstrap (the same check on every rank, in a second); the follower and
    logs show this line as they show an import error (the end-to-end cases below)."""
    (tmp_path / "code.py").write_text(code)
    with pytest.raises(UserCodeError) as error:
        load_function(Program("file", path=str(tmp_path / "code.py"), function="main"))
    assert str(error.value) == f"job.program {tmp_path}/code.py:main: " + says.format(tmp=tmp_path)


@pytest.mark.parametrize("case", CASES)
def test_a_failing_program_says_why_once_and_is_not_requeued(tmp_path: Path, case: str) -> None:
    program, code, says = CASES[case]
    (tmp_path / program.split(":")[0]).write_text(code)
    ranks = 2 if case == "rank-1-raises" else 1  # one rank is enough to fail to start
    (tmp_path / "job.toml").write_text(f'[job]\nname = "bad"\nprogram = "{program}"\ntasks_per_node = {ranks}\n')
    status, output = submit(tmp_path, str(tmp_path / "job.toml"))
    said = says.format(tmp=tmp_path)
    assert status == 1, output[-3000:]
    failed = [line for line in output.splitlines() if "failed: rank" in line]
    assert len(failed) == 1 and said in failed[0], output[-3000:]
    if case == "rank-1-raises":
        assert "rank 1 on" in failed[0]  # the rank that raised, not rank 0 that lost its peer
        # its traceback starts at the user's function, not in hpc_train's entry and runner
        shown = output.split(failed[0], 1)[1].splitlines()
        first = next(line for line in shown if line.strip().startswith("File "))
        assert f"{tmp_path}/code.py" in first and "before your code left out" in output, output[-3000:]
    runs = attempts(tmp_path / "runs" / "bad")
    assert len(runs) == 1 and runs[0]["outcome"] == "failed" and not runs[0]["requeued"], runs
    logs = subprocess.run([sys.executable, "-m", "hpc_train", "logs", str(tmp_path / "runs" / "bad"), "--errors-only"],
                          capture_output=True, text=True, timeout=60, check=False)
    assert said in logs.stdout, logs.stdout + logs.stderr


HANGS = """
import time


def main(ctx):
    ctx.log(1, loss=1.0)
    if ctx.rank == 1:
        time.sleep(600)  # no log, no should_stop: the watchdog's step timeout
    ctx.should_stop()
"""


def test_the_watchdog_finds_a_user_function_that_stops_making_progress(tmp_path: Path) -> None:
    (tmp_path / "hangs.py").write_text(HANGS)
    (tmp_path / "job.toml").write_text('[job]\nname = "hangs"\nprogram = "hangs.py:main"\ntasks_per_node = 2\n'
                                       "[watchdog]\nstep_timeout_s = 10\n[retry]\nhang = 0\n")
    status, output = submit(tmp_path, str(tmp_path / "job.toml"))
    assert status != 0, output[-3000:]
    run_dir = tmp_path / "runs" / "hangs"
    runs = attempts(run_dir)
    assert [a["outcome"] for a in runs] == ["hang"] and not runs[0]["requeued"], runs
    assert "no progress for" in str(runs[0]["note"]) and "watchdog.step_timeout_s = 10" in str(runs[0]["note"])
    stacks = (run_dir / "logs" / "stacks-rank-1.txt").read_text()
    assert f'File "{tmp_path}/hangs.py", line 8 in main' in stacks  # where it was stuck: the sleep
