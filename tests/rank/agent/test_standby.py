"""Standby ranks (``retry.standby``) with real processes: a standby with torch imported becomes the rank it is
handed (its pid, the rank's environment and arguments, every thread on the rank's CPU share), a rank whose
environment differs in what a library reads at import starts cold and says so once, and a standby that died is
passed over. Each case waits for one real standby (torch's import: seconds)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hpc_train.rank.agent.standby import StandbyPool

REPO = Path(__file__).resolve().parents[3]
MODULE = "tests.rank.agent.place_report"


def _pool(said: list[str], **extra: str) -> StandbyPool:
    env = {**os.environ, "PYTHONPATH": str(REPO), "HPC_TRAIN_TEST_STANDBY_ONLY": "1", **extra}
    return StandbyPool("program", 1, env, said.append)


def _rank(pool: StandbyPool, **changes: str | None) -> tuple[subprocess.Popen[bytes], dict[str, object]]:
    env = {**pool.env, "SLURM_PROCID": "3", "HPC_TRAIN_IN_PLACE": "1"}
    for name, value in changes.items():
        if value is None:
            env.pop(name, None)
        else:
            env[name] = value
    argv = [sys.executable, "-u", "-m", MODULE, "--flag", "x"]
    process = pool.start(argv, env, {0})
    return process, env


def _report(process: subprocess.Popen[bytes], output: Path) -> dict[str, object]:
    assert process.wait(timeout=120) == 0
    return json.loads(output.read_text().splitlines()[-1])


@pytest.fixture
def output(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Where the stand-in rank's line goes: the standby's and the rank's standard output, a file."""
    path = tmp_path / "out.txt"
    handle = path.open("wb")
    monkeypatch.setattr(subprocess, "Popen", _with_stdout(subprocess.Popen, handle))
    monkeypatch.chdir(REPO)
    return path


def _with_stdout(real: type, handle: object) -> object:
    def popen(*args: object, **kwargs: object) -> object:
        kwargs.setdefault("stdout", handle)
        return real(*args, **kwargs)
    return popen


def _ready(pool: StandbyPool, said: list[str]) -> None:
    deadline = time.monotonic() + 120
    while not said and time.monotonic() < deadline:
        pool.tick()
        time.sleep(0.05)
    assert said and said[0].startswith("1 standby rank(s) ready for the next life (imports done in "), said
    said.clear()


def test_a_standby_becomes_the_rank_it_is_handed(output: Path) -> None:
    said: list[str] = []
    pool = _pool(said)
    pool.refill()
    (standby,) = pool.pids
    _ready(pool, said)  # it says so once its imports are done
    with open(f"/proc/{standby}/oom_score_adj") as idle:  # the kernel's first choice while it is idle
        assert idle.read().strip() == "1000"
    process, _env = _rank(pool, HPC_TRAIN_TEST_STANDBY_ONLY=None)
    try:
        report = _report(process, output)
    finally:
        pool.close()
    assert process.pid == standby == report["pid"] and pool.used == 1
    assert report["name"] == "__main__" and report["argv"][1:] == ["--flag", "x"]
    assert report["procid"] == "3" and report["only_standby"] is None  # the rank's environment, whole
    assert report["torch"] is True  # imported before the rank was handed over
    with open("/proc/self/oom_score_adj") as own:  # a rank again: as a rank started cold
        assert report["oom_score_adj"] == own.read().strip()
    assert set(map(tuple, report["threads"].values())) == {(0,)}  # every thread on the rank's share
    assert not said


def test_a_rank_that_differs_in_what_an_import_reads_starts_cold_and_says_so_once(output: Path) -> None:
    said: list[str] = []
    pool = _pool(said)
    pool.refill()
    (standby,) = pool.pids
    try:
        process, _env = _rank(pool, OMP_NUM_THREADS="7")
        report = _report(process, output)
        again, _env = _rank(pool, OMP_NUM_THREADS="7")
        again.wait(timeout=120)
    finally:
        pool.close()
    assert report["pid"] != standby and report["torch"] is False and report["procid"] == "3"
    assert len(said) == 1 and "differs from the standby's in OMP_NUM_THREADS" in said[0], said


def test_a_standby_that_died_is_passed_over(output: Path) -> None:
    said: list[str] = []
    pool = _pool(said)
    pool.refill()
    (standby,) = pool.pids
    os.kill(standby, 9)
    os.waitid(os.P_PID, standby, os.WEXITED | os.WNOWAIT)  # dead, and left for the pool to reap
    try:
        process, _env = _rank(pool)
        report = _report(process, output)
    finally:
        pool.close()
    assert report["pid"] != standby and report["procid"] == "3" and pool.used == 0


def test_an_idle_standby_s_sigkill_is_counted_once_so_the_agent_does_not_take_it_for_a_rank_s_oom() -> None:
    """The kernel's OOM killer takes an idle standby first (oom_score_adj 1000); the agent subtracts such deaths
    from the node's OOM kills before it calls a rank's SIGKILL an out-of-memory kill. Counted before the pool
    drops the dead and starts another."""
    pool = _pool([])
    pool.refill()
    try:
        (standby,) = pool.pids
        assert pool.sigkilled() == 0
        os.kill(standby, 9)
        os.waitid(os.P_PID, standby, os.WEXITED | os.WNOWAIT)
        pool.refill()  # the dead one dropped, a new one started
        assert pool.sigkilled() == 1 and standby not in pool.pids and len(pool.pids) == 1
        assert pool.sigkilled() == 1  # once
    finally:
        pool.close()
