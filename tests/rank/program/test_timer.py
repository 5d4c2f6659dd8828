"""``ctx.timer("name")`` in a user function: the wall time of each section since the previous ``ctx.log`` goes into
that record as ``NAME_ms``; a name that cannot be a metric is refused with one message."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


def test_timed_sections_go_into_the_next_record(tmp_path: Path) -> None:
    job = tmp_path / "job.toml"
    out = tmp_path / "refused.txt"
    job.write_text(f'[job]\nname = "timed"\nprogram = "{Path(__file__).parent / "timed_loop.py"}:main"\n'
                   f'tasks_per_node = 1\n[params]\nout = "{out}"\n[monitor]\ntensorboard = false\n')
    result = subprocess.run([sys.executable, "-m", "hpc_train.submit", str(job), "--site", "local"], cwd=tmp_path,
                            capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "runs" / "timed" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [2, 4, 6]
    for record in records:  # two steps each: at least their sleeps; the bound above only catches a sum that is
        # never reset (the loaded machine of CI once stretched 20 ms of sleeps to 93 ms)
        assert 40 <= record["load_ms"] < 1000 and 20 <= record["compute_ms"] < 1000, record
    assert "ctx.timer('bad name'): a timer's name is a metric name" in out.read_text()
