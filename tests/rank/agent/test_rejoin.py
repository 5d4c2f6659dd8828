"""Warm restarts between an agent's pool and a real process (``tests/rank/agent/warm_rank.py``, a stand-in for a
trainer's rank): a rank started with the channel reads as ended with ``EXIT_RESTART_IN_PLACE`` once it says it is
warm, keeps its process through the agent's end of the life, and takes the next life's order in it; a warm
process the next life does not take, or whose environment no longer fits, is ended, and its rank starts anew."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from hpc_train.rank.agent.rejoin import RankProcess, RejoinChannel, order_line
from hpc_train.rank.agent.standby import StandbyPool
from hpc_train.run.exit_codes import EXIT_RESTART_IN_PLACE

REPO = Path(__file__).resolve().parents[3]
ARGV = [sys.executable, "-u", "-m", "tests.rank.agent.warm_rank"]


@pytest.fixture
def output(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The stand-in's lines go to a file (its standard output)."""
    path = tmp_path / "out.txt"
    handle = path.open("ab")  # O_APPEND: two processes' lines never interleave
    real = subprocess.Popen

    def popen(*args: object, **kwargs: object) -> object:
        kwargs.setdefault("stdout", handle)
        return real(*args, **kwargs)

    monkeypatch.setattr(subprocess, "Popen", popen)
    monkeypatch.chdir(REPO)
    return path


class Pool(StandbyPool):
    """An agent's pool of standbys and warm ranks (one standby), with the lines it said kept in ``said``."""

    def __init__(self) -> None:
        self.said: list[str] = []
        super().__init__("train", 1, {**os.environ, "PYTHONPATH": str(REPO)}, self.said.append)


@pytest.fixture
def pool(output: Path) -> Iterator[Pool]:
    """The pool, closed after the test (the processes it started or kept warm are ended)."""
    made = Pool()
    try:
        yield made
    finally:
        made.close()


def _env(pool: StandbyPool, life: int, **more: str) -> dict[str, str]:
    return {**pool.env, "SLURM_PROCID": "3", "HPC_TRAIN_IN_PLACE": str(life), "HPC_TRAIN_TEST_LIFE": str(life), **more}


def _lines(output: Path, count: int) -> list[dict[str, object]]:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        lines = [json.loads(line) for line in output.read_text().splitlines(keepends=True)
                 if line.startswith("{") and line.endswith("\n")]  # a line being written is read next time
        if len(lines) >= count:
            return lines
        time.sleep(0.05)
    raise AssertionError(f"{count} line(s) expected: {output.read_text()!r}")


def _until_warm(process: RankProcess) -> None:
    deadline = time.monotonic() + 60
    while process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert process.poll() == EXIT_RESTART_IN_PLACE and process.wait() == EXIT_RESTART_IN_PLACE


def _warm_rank(pool: StandbyPool) -> RankProcess:
    """Rank 3 of a life started by ``pool`` (a new process with the channel), once it has said it is warm."""
    rank = pool.start(ARGV, _env(pool, 0), None, rank=3)
    pool.schedule()
    assert isinstance(rank, RankProcess)
    _until_warm(rank)
    return rank


def test_a_warm_rank_trains_the_next_life_in_its_own_process(pool: Pool, output: Path) -> None:
    first = _warm_rank(pool)
    assert first.pid in pool.pids, "the agent's end of the life keeps a warm rank's process"
    again = pool.start([*ARGV, "--next"], _env(pool, 1), None, rank=3)
    pool.schedule()
    assert again is first and again.poll() is None, "the order went to the same process, running again"
    assert any("1 rank(s) of this node restarted warm" in line for line in pool.said), pool.said
    lines = _lines(output, 2)
    assert [line["pid"] for line in lines] == [first.pid, first.pid]
    assert [line["life"] for line in lines] == ["0", "1"] and lines[1]["argv"] == ["--next"]
    assert all(line["channel"] and line["stdin_is_null"] and not line["variable_left"] for line in lines), lines
    _until_warm(again)
    pool.close()
    assert first.process.poll() is not None, "closing the pool ends a warm process"


def test_before_a_restart_the_agent_waits_briefly_for_ranks_to_say_they_are_warm(pool: Pool, output: Path) -> None:
    """A rank that says so is ended (EXIT_RESTART_IN_PLACE) and kept; one that stays busy is left to the kill."""
    warm = pool.start(ARGV, _env(pool, 0), None, rank=3)
    busy = pool.start(ARGV, _env(pool, 0, HPC_TRAIN_TEST_BUSY="1"), None, rank=4)
    pool.schedule()
    _lines(output, 2)  # both are up
    ended: dict[int, int] = {}
    waited = time.monotonic()
    pool.await_warm({3: warm, 4: busy}, ended)
    waited = time.monotonic() - waited
    assert ended == {3: EXIT_RESTART_IN_PLACE}, ended
    assert isinstance(busy, RankProcess) and busy.poll() is None and waited < 30
    assert warm.pid in pool.pids and busy.pid not in pool.pids


def test_a_warm_rank_the_next_life_does_not_take_is_ended(pool: Pool, output: Path) -> None:
    first = _warm_rank(pool)
    other = pool.start(ARGV, _env(pool, 1), None, rank=4)  # rank 3 is not on this node in the next life
    pool.schedule()
    assert first.process.wait(timeout=30) == -signal.SIGKILL and other.pid != first.pid


def test_a_warm_rank_whose_environment_no_longer_fits_starts_anew(pool: Pool, output: Path) -> None:
    first = _warm_rank(pool)
    second = pool.start(ARGV, _env(pool, 1, OMP_NUM_THREADS="7"), None, rank=3)  # read at import
    assert second.pid != first.pid and first.process.wait(timeout=30) == -signal.SIGKILL
    assert any("OMP_NUM_THREADS" in line for line in pool.said), pool.said


def test_the_channel_refuses_what_is_not_two_open_descriptors() -> None:
    for value in ("", "1", "a,b", "0,1,2", "987654,987655", "0,1", "0,2"):  # never stdout or stderr
        environ = {"HPC_TRAIN_REJOIN": value}
        assert RejoinChannel.adopt(environ) is None
        assert "HPC_TRAIN_REJOIN" not in environ


def test_an_order_that_is_not_a_rank_s_is_refused() -> None:
    orders_read, orders_write = os.pipe()
    warm_read, warm_write = os.pipe()
    channel = RejoinChannel(orders_read, warm_write)
    try:
        assert channel.say_warm() and os.read(warm_read, 1) == b"w"
        for bad in (b'{"argv": "not a list", "env": {}}', b'{"argv": ["x", 1], "env": {}}',
                    b'{"argv": ["x"], "env": {"A": 1}}', b'{"argv": ["x"], "env": {}, "cpus": [-1]}',
                    b'{"argv": ["x"], "env": {}, "cpus": "0-3"}', b'[1, 2]'):
            os.write(orders_write, bad + b"\n")
            assert channel.read_order() is None, bad
        os.write(orders_write, order_line(["python", "-u", "-m", "x"], {"A": "1"}, {2, 1}))
        assert channel.read_order() == {"argv": ["python", "-u", "-m", "x"], "env": {"A": "1"}, "cpus": [1, 2]}
        os.close(orders_write)
        orders_write = -1
        assert channel.read_order() is None, "the agent closed the channel"
    finally:
        for descriptor in (orders_read, warm_read, warm_write, orders_write):
            if descriptor >= 0:
                os.close(descriptor)
