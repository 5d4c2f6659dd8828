"""`hpc_train cancel`, and Ctrl-C to `submit`, on the local executor with real ranks: the ranks end, the attempt
is recorded as cancelled by the user, ``status`` says so, and no traceback reaches the terminal."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.slow
EXAMPLE = str(REPO / "examples" / "tiny_gpt.toml")
LONG = ["--site", "local", "--set", "train.steps=100000", "--set", "checkpoint.every_steps=0"]


def _wait_for_steps(run_dir: Path, timeout_s: float = 180) -> None:
    deadline = time.monotonic() + timeout_s
    metrics = run_dir / "metrics.jsonl"
    while not (metrics.exists() and metrics.read_text().strip()):
        assert time.monotonic() < deadline, f"no step logged in {run_dir}"
        time.sleep(0.2)


def _ranks_of(run_dir: Path) -> str:
    return subprocess.run(["pgrep", "-fa", str(run_dir)], capture_output=True, text=True, check=False).stdout


def _last_attempt(run_dir: Path) -> dict[str, object]:
    return json.loads((run_dir / "attempts.jsonl").read_text().splitlines()[-1])


def _status(run_dir: Path) -> dict[str, object]:
    out = subprocess.run([sys.executable, "-m", "hpc_train", "status", str(run_dir), "--json"], capture_output=True,
                         text=True, timeout=60, check=True).stdout
    return json.loads(out)["runs"][0]


@pytest.mark.parametrize("to_group", [True, False], ids=["terminal-ctrl-c", "sigint-to-submit"])
def test_ctrl_c_while_following_ends_the_ranks_and_records_the_cancel(tmp_path: Path, to_group: bool) -> None:
    """A terminal's Ctrl-C reaches the whole foreground process group; ``kill -INT`` the submit process alone.
    Either way the ranks (which lead a session of their own) are ended by submit and the attempt recorded."""
    submit = subprocess.Popen([sys.executable, "-m", "hpc_train.submit", EXAMPLE, *LONG], cwd=tmp_path,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    run_dir = tmp_path / "runs" / "tiny-gpt"
    try:
        _wait_for_steps(run_dir)
        if to_group:
            os.killpg(submit.pid, signal.SIGINT)
        else:
            submit.send_signal(signal.SIGINT)
        out, _ = submit.communicate(timeout=60)
    finally:
        if submit.poll() is None:
            os.killpg(submit.pid, signal.SIGKILL)
    assert submit.returncode == 130, out
    assert "stopped job" in out and "recorded as cancelled by the user" in out, out
    assert "Traceback" not in out and "KeyboardInterrupt" not in out, out
    assert not _ranks_of(run_dir), _ranks_of(run_dir)
    last = _last_attempt(run_dir)
    assert last["outcome"] == "cancelled" and "Ctrl-C to submit" in str(last["note"]), last
    status = _status(run_dir)
    assert status["state"] == "CANCELLED", status
    assert "by the user" in json.dumps(status["failure"]), status


def test_hpc_train_cancel_ends_a_local_run_and_refuses_what_it_cannot_cancel(tmp_path: Path) -> None:
    with (tmp_path / "submit.out").open("w") as out:  # the local job's processes keep the file open, not a pipe
        submitted = subprocess.run([sys.executable, "-m", "hpc_train.submit", EXAMPLE, *LONG, "--no-follow"],
                                   cwd=tmp_path, stdout=out, stderr=subprocess.STDOUT, timeout=120, check=False)
    assert submitted.returncode == 0, (tmp_path / "submit.out").read_text()
    run_dir = tmp_path / "runs" / "tiny-gpt"
    _wait_for_steps(run_dir)
    cancel = [sys.executable, "-m", "hpc_train", "cancel", str(run_dir)]
    done = subprocess.run(cancel, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0 and "cancelled local job" in done.stdout, done.stdout + done.stderr
    assert not _ranks_of(run_dir), _ranks_of(run_dir)
    assert _last_attempt(run_dir)["outcome"] == "cancelled"
    again = subprocess.run(cancel, capture_output=True, text=True, timeout=60, check=False)
    assert again.returncode == 2 and "has no local job running here" in again.stderr, again.stderr
    elsewhere = subprocess.run([*cancel[:-1], str(tmp_path)], capture_output=True, text=True, timeout=60, check=False)
    assert elsewhere.returncode == 2 and "is not a run folder" in elsewhere.stderr, elsewhere.stderr
    (tmp_path / "link").symlink_to(run_dir)
    linked = subprocess.run([*cancel[:-1], str(tmp_path / "link")], capture_output=True, text=True, timeout=60,
                            check=False)
    assert linked.returncode == 2 and "symbolic link" in linked.stderr and "Traceback" not in linked.stderr


def test_a_killed_submit_takes_its_followed_local_job_with_it(tmp_path: Path) -> None:
    """The ranks lead a session of their own (so Ctrl-C reaches submit alone), yet never train on unfollowed:
    the controller dies with submit, and each rank with the controller (``PR_SET_PDEATHSIG``)."""
    with (tmp_path / "submit.out").open("w") as out:
        submit = subprocess.Popen([sys.executable, "-m", "hpc_train.submit", EXAMPLE, *LONG], cwd=tmp_path,
                                  stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    run_dir = tmp_path / "runs" / "tiny-gpt"
    try:
        _wait_for_steps(run_dir)
        assert _ranks_of(run_dir), "no rank found to follow"
        submit.kill()  # SIGKILL: no handler runs
        submit.wait(timeout=30)
        deadline = time.monotonic() + 30
        while _ranks_of(run_dir) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _ranks_of(run_dir), _ranks_of(run_dir)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(submit.pid, signal.SIGKILL)
