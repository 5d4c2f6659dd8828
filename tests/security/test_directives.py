"""Values that reach #SBATCH lines or shell words: smuggled directives are refused, quoted payloads stay inert.

Why: shlex.quote protects a shell word but not an ``#SBATCH`` line (a newline ends the directive and the rest is
a shell command), so every job and site key that reaches a directive must refuse line breaks of any kind (\\n,
\\r, NUL, U+2028, U+0085) with exit 2; values that are legitimately accepted ($(...) in an [env] value) must come
out of every template (srun, torchrun, mpirun) and submitit's script quoted, which running them under bash with
stub Slurm tools proves: the canary stays absent.
"""

from __future__ import annotations

import pytest

from tests.security.harness import Case, World, across, cases_ids, on, q, run_case, site_toml

WRAP = "#SBATCH --wrap=touch @CANARY@"
BREAKS = [("nl", f"x\n{WRAP}"), ("cr", f"x\r{WRAP}"), ("nul", "x\x00touch @CANARY@"), ("u2028", f"x\u2028{WRAP}"),
          ("u0085", f"x\x85{WRAP}")]
JOB_STRINGS = {"name": "x", "partition": "batch", "account": "acct", "qos": "normal", "constraint": "cpu",
               "mem": "1G", "time": "01:00:00", "exclude": "n1", "run_root": "@RUNS@"}


def _job_smuggling() -> list[Case]:
    cases = []
    for key, good in JOB_STRINGS.items():
        for label, tail in BREAKS:
            value = good + tail.removeprefix("x")
            cases.append(on("render", f"job-{key}-{label}", f"[job]\n{key} = {q(value)}\n", says=(f"job.{key}",)))
    for label, tail in BREAKS:
        cases.append(on("render", f"job-forward_env-{label}", f"[job]\nforward_env = [{q('HOME_X' + tail[1:])}]\n",
                        says=("job.forward_env",)))
    for key in ("name", "partition", "exclude"):
        for label in ("nl", "u2028"):
            value = JOB_STRINGS[key] + dict(BREAKS)[label].removeprefix("x")
            cases.append(on("submit", f"job-{key}-{label}-submit", f"[job]\n{key} = {q(value)}\n",
                            says=(f"job.{key}",)))
    return cases


SITE_STRINGS = {"slurm.partition": "batch", "slurm.account": "acct", "slurm.qos": "normal", "slurm.constraint": "cpu",
                "slurm.max_time": "1-00:00:00", "node.mem": "4G", "software.python": "/usr/bin/python3",
                "container.image": "docker://pytorch", "network.socket_ifname": "lo", "network.fabric_suffix": "-ib",
                "preempt.signal": "USR2", "run_root": "@RUNS@", "name": "hostile"}
SITE_LISTS = {"launch.srun_args": "--mpi=pmi2", "software.modules": "cuda/12.4", "container.mounts": "/a:/b"}


def _site_smuggling() -> list[Case]:
    cases = []
    for label in ("nl", "u2028", "u0085"):
        tail = dict(BREAKS)[label].removeprefix("x")
        for key, good in SITE_STRINGS.items():
            cases.append(on("render", f"site-{key}-{label}", "", site=site_toml({key: q(good + tail)}), says=(key,)))
        for key, good in SITE_LISTS.items():
            cases.append(on("render", f"site-{key}-{label}", "", site=site_toml({key: f"[{q(good + tail)}]"}),
                            says=(key,)))
    return cases


NAMES = [("newline", "a\nb"), ("slash", "a/b"), ("dotdot", ".."), ("dot", "."), ("dash", "-x"), ("long", "a" * 200),
         ("space", "a b"), ("subst", "$(touch @CANARY@)"), ("backtick", "`touch @CANARY@`"), ("unicode", "été"),
         ("empty", "")]
HOSTLISTS = [("open", "n[1-"), ("reversed", "n[5-1]"), ("double-comma", "a,,b"), ("two-million", "n[1-2000000]"),
             ("extra-bracket", "n[1-2]]"), ("no-prefix", "[1-2]"), ("trillion", "n[01-1000000000000]"),
             ("leading-comma", ",a"), ("trailing-comma", "a,"), ("letters", "n[a-b]"), ("ten-million", "n[1-10000000]"),
             ("nested", "n[1-[2]]"), ("empty-range", "n[]")]
TIMES = [("arabic-indic", "٠١:٠٠:٠٠"), ("fullwidth", "０１:００:００"), ("superscript", "⁰¹:⁰⁰:⁰⁰"),
         ("trailing-space", "01:00:00 "), ("plus", "+60")]
NUMBERS = [("nodes-2-70", "[job]\nnodes = 1180591620717411303424\n", "job.nodes"),
           ("nodes-int64-max", "[job]\nnodes = 9223372036854775807\n", "job.nodes"),
           ("nodes-over-cap", "[job]\nnodes = 1000000\n", "job.nodes"),
           ("tasks-per-node-huge", "[job]\ntasks_per_node = 4294967296\n", "job.tasks_per_node"),
           ("cpus-per-task-huge", "[job]\ncpus_per_task = 4294967296\n", "job.cpus_per_task"),
           ("steps-2-63", "[train]\nsteps = 9223372036854775808\n", "train.steps"),
           ("keep-2-70", "[checkpoint]\nkeep = 1180591620717411303424\n", "checkpoint.keep"),
           ("nodes-negative-zero", "[job]\nnodes = -0\n", "job.nodes"),
           ("lr-negative-zero", "[train]\nlr = -0.0\n", "train.lr"),
           ("nodes-float", "[job]\nnodes = 2.0\n", "job.nodes")]


def _value_cases() -> list[Case]:
    cases = [on("render", f"name-{label}", f"[job]\nname = {q(value)}\n", says=("job.name",)) for label, value in NAMES]
    for label, value in HOSTLISTS:
        cases += across("dry render", f"exclude-{label}", f"[job]\nexclude = {q(value)}\n", says=("job.exclude",))
    for label, value in TIMES:
        cases += across("dry render", f"time-{label}", f"[job]\ntime = {q(value)}\n", says=("job.time",))
    cases += [on("dry", f"number-{label}", toml, says=(key,)) for label, toml, key in NUMBERS]
    cases += [on("render", "number-nodes-2-70-render", NUMBERS[0][1], says=("job.nodes",))]
    return cases


PAYLOADS = [("subst", "[env]\nFOO = \"$(touch @CANARY@)\"\n"), ("backtick", "[env]\nFOO = \"`touch @CANARY@`\"\n"),
            ("quote-break", "[env]\nFOO = \"'; touch @CANARY@; '\"\n"),
            ("double-quote-break", "[env]\nFOO = '\"; touch @CANARY@; \"'\n"),
            ("ifs", "[env]\nFOO = \"${IFS}touch${IFS}@CANARY@\"\n"),
            ("semicolon", "[env]\nFOO = \";touch @CANARY@\"\n"),
            ("args", "[job]\nargs = [\"$(touch @CANARY@)\", \"; touch @CANARY@\", \"`touch @CANARY@`\"]\n"),
            ("params", "[params]\ncmd = \"$(touch @CANARY@)\"\n")]


def _inert(world: World, outcome: object) -> None:
    """The accepted value is exported as it was written, inside quotes."""
    scripts = [p for p in world.run_dir.glob("*.sbatch")] + list(world.captured.iterdir())
    assert scripts, "no script was written"
    for script in scripts:
        for line in script.read_text(encoding="utf-8").splitlines():
            assert not line.startswith("#SBATCH --wrap"), f"{script.name}: {line}"


def _accepted_payloads() -> list[Case]:
    cases = []
    for label, toml in PAYLOADS:
        for template in ("srun", "torchrun", "mpirun"):
            cases.append(on("render", f"payload-{label}-{template}", toml, "--template", template, expect=0,
                            check=_inert))
        cases += across("stdout submit", f"payload-{label}", toml, expect=0)
    cases.append(on("dry", "payload-subst-dry", PAYLOADS[0][1], expect=0, shows=("$(touch",)))
    cases.append(on("render", "payload-set-env", "", "--set", "env.FOO=$(touch @CANARY@)", expect=0, check=_inert))
    cases.append(on("submit", "payload-site-module", "", expect=0,
                    site=site_toml({"software.modules": '["cuda/12.4"]'})))
    return cases


CASES = [*_job_smuggling(), *_site_smuggling(), *_value_cases(), *_accepted_payloads()]


@pytest.mark.parametrize("case", CASES, ids=cases_ids(CASES))
def test_directive_values(case: Case, world: World) -> None:
    run_case(case, world)
