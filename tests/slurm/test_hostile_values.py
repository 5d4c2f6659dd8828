"""A corpus of hostile values in every user-settable field: each is refused, or it renders into a script
that, run for real by bash, executes nothing but the intended launch line.

The script runs with stub ``srun``/``mpirun``/``scontrol``/``module``/``python`` on PATH (a cluster is not
needed to prove the shell does not execute a payload); each payload would create a canary file.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest

from hpc_train.config.job import JobConfig
from hpc_train.config.loader import build
from hpc_train.config.plan import make_plan
from hpc_train.config.sites import load_site
from hpc_train.errors import ConfigError
from hpc_train.login.slurm.render import TEMPLATES, render_script

PAYLOADS = [
    "x\ntouch {c}\n#",
    "x\r\ntouch {c}",
    "$(touch {c})",
    "`touch {c}`",
    "'; touch {c}; '",
    '"; touch {c}; "',
    "x; touch {c}",
    "x && touch {c}",
    "x | touch {c}",
    "x\n#SBATCH --wrap=touch {c}",
    "#SBATCH --output=/etc/passwd",
    "${{IFS}}touch${{IFS}}{c}",
    "x\x00y; touch {c}",
    "\\\ntouch {c}",
    "--uid=0 $(touch {c})",
    "a\u2028touch {c}",
]

# (table path, key) of every string a user or site can set; [] marks a list item.
JOB_FIELDS = [("job", "name"), ("job", "partition"), ("job", "account"), ("job", "qos"), ("job", "constraint"),
              ("job", "exclude"), ("job", "mem"), ("job", "time"), ("job", "run_root"), ("job", "forward_env[]"),
              ("preempt", "signal"), ("env", "HPC_TRAIN_EXAMPLE"), ("env", "<key>")]
SITE_FIELDS = [("slurm", "partition"), ("slurm", "account"), ("slurm", "qos"), ("slurm", "constraint"),
               ("node", "mem"), ("network", "socket_ifname"), ("network", "fabric_suffix"), ("network", "hcas[]"),
               ("network.nccl", "NCCL_DEBUG"), ("software", "modules[]"), ("software", "python"),
               ("container", "image"), ("container", "mounts[]"), ("env", "SITE_VALUE"), ("preempt", "signal")]
STUBS = {
    "srun": 'while [[ "$1" == --* ]]; do case "$1" in --output|--error) shift 2;; *) shift;; esac; done; exec "$@"',
    "mpirun": 'while [[ "$1" == -* ]]; do case "$1" in -np|--map-by|--bind-to|-x) shift 2;; *) shift;; esac; done;'
              ' exec "$@"',
    "scontrol": "echo n1",
    "module": "exit 0",
    "apptainer": 'shift; while [[ "$1" == --* ]]; do shift; [[ "$1" != --* ]] && shift; done; shift; exec "$@"',
    "python": 'printf "%s\\0" "$@" > "$HT_ARGV"; printf "%s" "${HPC_TRAIN_EXAMPLE-}" > "$HT_ENV"; '
              'printf "%s %s" "${MASTER_ADDR-}" "${MASTER_PORT-}" > "$HT_ENV.rdzv"',
}


def _set(table: dict[str, Any], dotted: str, key: str, value: str) -> None:
    for part in dotted.split("."):
        table = table.setdefault(part, {})
    if key == "<key>":
        table[value] = "x"
    elif key.endswith("[]"):
        table[key[:-2]] = [value]
    else:
        table[key] = value


def _toml(data: dict[str, Any], prefix: str = "") -> str:
    scalars = [f"{json.dumps(k)} = {json.dumps(v)}" for k, v in data.items() if not isinstance(v, dict)]
    tables = [_toml(v, f"{prefix}{k}.") for k, v in data.items() if isinstance(v, dict)]
    head = f"[{prefix[:-1]}]\n" if prefix else ""
    return head + "\n".join(scalars) + "\n" + "".join(tables)


def _stub_bin(tmp: Path) -> Path:
    folder = tmp / "bin"
    folder.mkdir()
    for name, body in STUBS.items():
        path = folder / name
        path.write_text(f"#!/bin/bash\n{body}\n", encoding="utf-8")
        path.chmod(0o755)
    return folder


def _plan(tmp: Path, job: dict[str, Any], site: dict[str, Any]) -> Any:
    (tmp / "job.toml").write_text(_toml(job), encoding="utf-8")
    (tmp / "site.toml").write_text(_toml(site), encoding="utf-8")
    from hpc_train.config.loader import load_toml

    cfg = build(JobConfig, load_toml(tmp / "job.toml", "config"))
    return make_plan(cfg, load_site(str(tmp / "site.toml")), "slurm", python=str(tmp / "bin" / "python"), cwd=tmp)


def _run_script(tmp: Path, text: str) -> subprocess.CompletedProcess[str]:
    script = tmp / "job.sbatch"
    script.write_text(text, encoding="utf-8")
    env = {"PATH": f"{tmp / 'bin'}:/usr/bin:/bin", "HOME": str(tmp), "SLURM_JOB_ID": "4242",
           "SLURM_JOB_NODELIST": "n1", "SLURM_NNODES": "1", "SLURM_NODEID": "0", "SLURM_NTASKS": "2",
           "HT_ARGV": str(tmp / "argv"), "HT_ENV": str(tmp / "env")}
    return subprocess.run(["bash", str(script)], cwd=tmp, env=env, capture_output=True, text=True, timeout=20,
                          check=False)


CASES = [("job", *field) for field in JOB_FIELDS] + [("site", *field) for field in SITE_FIELDS]


@pytest.mark.parametrize(("owner", "table", "key"), CASES, ids=[f"{o}:{t}.{k}" for o, t, k in CASES])
def test_hostile_values_never_execute(tmp_path: Path, owner: str, table: str, key: str) -> None:
    _stub_bin(tmp_path)
    canary = tmp_path / "PWNED"
    refused = accepted = 0
    for payload in PAYLOADS:
        value = payload.format(c=canary)
        job: dict[str, Any] = {"job": {"name": "hostile", "nodes": 1, "tasks_per_node": 2}}
        site: dict[str, Any] = {"name": "hostile-site", "slurm": {"enabled": True}, "node": {"cpus": 8}}
        if table == "container":
            site["container"] = {"runtime": "apptainer", "image": "/img/x.sif"}
        _set(job if owner == "job" else site, table, key, value)
        for template in TEMPLATES:
            try:
                text = render_script(_plan(tmp_path, job, site), template).text
            except ConfigError:
                refused += 1
                continue
            accepted += 1
            directives = [line for line in text.splitlines() if line.startswith("#SBATCH")]
            assert all(re.fullmatch(r"#SBATCH --[a-z-]+(=[^\s'\"`$;]+)?", line) for line in directives), directives
            assert len(directives) == len({line.split("=")[0] for line in directives})
            assert subprocess.run(["bash", "-n", "-c", text], check=False).returncode == 0
            result = _run_script(tmp_path, text)
            assert not canary.exists(), f"{template}: payload {value!r} in {table}.{key} ran\n{text}"
            assert result.returncode == 0, result.stderr
            argv = (tmp_path / "argv").read_text().split("\0")
            assert argv[-2:] == [str(tmp_path / "runs" / "hostile"), ""], argv  # the launch line is intact
            if (table, key) == ("env", "HPC_TRAIN_EXAMPLE"):
                assert (tmp_path / "env").read_text() == value  # quoting round-trips the exact value
    if (table, key) in (("env", "HPC_TRAIN_EXAMPLE"), ("env", "SITE_VALUE")):
        assert accepted > 0  # values are quoted, not refused: the run-the-script path really ran
    assert not canary.exists()


def test_accepted_values_really_are_exercised(tmp_path: Path) -> None:
    """Env values are quoted rather than refused, so the run-the-script path is not vacuous."""
    _stub_bin(tmp_path)
    job = {"job": {"name": "hostile", "tasks_per_node": 2}, "env": {"HPC_TRAIN_EXAMPLE": "$(touch X) `y` 'q'"}}
    site = {"name": "s", "slurm": {"enabled": True}, "node": {"cpus": 8}}
    text = render_script(_plan(tmp_path, job, site), "srun").text
    assert _run_script(tmp_path, text).returncode == 0
    assert (tmp_path / "env").read_text() == "$(touch X) `y` 'q'"
    # The script's rendezvous is the one every rank computes in Python (one formula, two places).
    from hpc_train.rank.distributed.rendezvous import derive_port

    assert (tmp_path / "env.rdzv").read_text() == f"n1 {derive_port('4242', 0, 20000, 32768)}"
    assert not (tmp_path / "X").exists()


SUBMITIT_FIELDS = [("job", "name"), ("job", "partition"), ("job", "account"), ("job", "constraint"),
                   ("job", "mem"), ("job", "forward_env[]"), ("env", "HPC_TRAIN_EXAMPLE"), ("software", "modules[]"),
                   ("launch", "srun_args[]"), ("env", "SITE_VALUE")]


@pytest.mark.parametrize(("table", "key"), SUBMITIT_FIELDS, ids=[f"{t}.{k}" for t, k in SUBMITIT_FIELDS])
def test_hostile_values_never_execute_through_submitit(tmp_path: Path, table: str, key: str) -> None:
    """The submitit path writes its own sbatch script (setup lines, srun flags, directives): render it with
    submitit itself and run it with bash."""
    from submitit.slurm.slurm import _make_sbatch_string

    from hpc_train.login.slurm.executors import submitit_parameters

    _stub_bin(tmp_path)
    canary = tmp_path / "PWNED"
    accepted = 0
    for payload in PAYLOADS:
        value = payload.format(c=canary)
        job: dict[str, Any] = {"job": {"name": "hostile", "nodes": 1, "tasks_per_node": 2}}
        site: dict[str, Any] = {"name": "hostile-site", "slurm": {"enabled": True}, "node": {"cpus": 8}}
        owner = job if table in ("job",) or (table, key) == ("env", "HPC_TRAIN_EXAMPLE") else site
        _set(owner, table, key, value)
        try:
            params = submitit_parameters(_plan(tmp_path, job, site))
        except ConfigError:
            continue
        text = _make_sbatch_string(command=f"{tmp_path / 'bin' / 'python'} -u -m submitit.core._submit x",
                                   folder=str(tmp_path / "sub"), **params)
        directives = [line for line in text.splitlines() if line.startswith("#SBATCH")]
        assert all(re.fullmatch(r"#SBATCH --[a-z-]+(=[^\s'\"`$;]+)?", line) for line in directives), directives
        accepted += 1
        result = _run_script(tmp_path, text)
        assert not canary.exists(), f"payload {value!r} in {table}.{key} ran\n{text}"
        assert result.returncode == 0, result.stderr
        if (table, key) == ("env", "HPC_TRAIN_EXAMPLE"):
            assert (tmp_path / "env").read_text() == value
    if table == "env":
        assert accepted > 0  # quoted, not refused: the script really ran with them
