"""Rendered sbatch scripts: a golden file per template x site, and every script parses with bash -n."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

from hpc_train.config.sites import available_sites, load_site
from hpc_train.errors import ConfigError
from hpc_train.login.slurm.render import TEMPLATES, render_script, template_names
from hpc_train.resources import shipped_dir
from tests.slurm.helpers import plan_for

GOLDEN = Path(__file__).parent / "golden"
SHIPPED_SITES = sorted(p.stem for p in shipped_dir("site_configs").glob("*.toml"))
SLURM_SITES = [name for name in SHIPPED_SITES if load_site(name).slurm.enabled]
COMBOS = [(template, site) for template in TEMPLATES for site in SLURM_SITES]
# mpirun cannot start ranks in pyxis containers: rendering refuses it (its golden file records the message).
RENDERABLE = [(t, s) for t, s in COMBOS if not (t == "mpirun" and load_site(s).container.runtime == "pyxis")]
UPDATE = os.environ.get("HPC_TRAIN_UPDATE_GOLDEN") == "1"


def _render(template: str, site: str) -> str:
    return render_script(plan_for(site), template).text


def test_every_template_is_shipped() -> None:
    assert template_names() == sorted(TEMPLATES)


def test_at_least_five_sites_are_shipped() -> None:
    assert {"local", "local-slurm"} <= set(SHIPPED_SITES) and len(SHIPPED_SITES) >= 5
    assert set(SHIPPED_SITES) <= set(available_sites())


def test_sites_without_slurm_refuse_to_render() -> None:
    with pytest.raises(ConfigError, match="site local has no Slurm"):
        plan_for("local")


@pytest.mark.parametrize(("template", "site"), COMBOS)
def test_golden_file(template: str, site: str) -> None:
    """A change to a rendered script must be deliberate: rerun with HPC_TRAIN_UPDATE_GOLDEN=1 and review."""
    try:
        text = _render(template, site)
    except ConfigError as error:
        text = f"# refused: {error}\n"
    path = GOLDEN / f"{template}-{site}.sbatch"
    if UPDATE:
        GOLDEN.mkdir(exist_ok=True)
        path.write_text(text, encoding="utf-8")
    assert path.exists(), f"no golden file {path.name}: run HPC_TRAIN_UPDATE_GOLDEN=1 pytest {__file__}"
    assert text == path.read_text(encoding="utf-8"), (
        f"{path.name} changed; if intended, run HPC_TRAIN_UPDATE_GOLDEN=1 pytest {__file__} and review the diff")


@pytest.mark.parametrize(("template", "site"), RENDERABLE)
def test_rendered_script_parses_with_bash(tmp_path: Path, template: str, site: str) -> None:
    text = _render(template, site)
    script = tmp_path / "job.sbatch"
    script.write_text(text, encoding="utf-8")
    result = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize(("template", "site"), RENDERABLE)
def test_directives_are_one_token_each_and_come_first(template: str, site: str) -> None:
    lines = _render(template, site).splitlines()
    directives = [line for line in lines if line.startswith("#SBATCH")]
    assert lines[0] == "#!/bin/bash -l"
    assert lines[1 : 1 + len(directives)] == directives  # all directives right after the shebang
    for line in directives:
        assert re.fullmatch(r"#SBATCH --[a-z-]+(=[^\s'\"`$;]+)?", line), line
    flags = [line.split()[1].split("=")[0] for line in directives]
    assert len(flags) == len(set(flags))
    assert "--requeue" in flags and "--signal" in flags
    assert not any("B:" in line for line in directives if line.startswith("#SBATCH --signal"))


@pytest.mark.parametrize(("template", "site"), sorted(set(COMBOS) - set(RENDERABLE)))
def test_mpirun_is_refused_in_pyxis_containers(template: str, site: str) -> None:
    with pytest.raises(ConfigError, match="mpirun cannot start ranks inside pyxis containers"):
        _render(template, site)


def test_torchrun_asks_one_task_per_node_with_all_cores() -> None:
    text = _render("torchrun", "local-slurm")
    assert "#SBATCH --ntasks-per-node=1\n" in text and "#SBATCH --cpus-per-task=2\n" in text
    assert "--nproc-per-node=\"$nproc\"" in text


def test_forwarded_variables_are_named_never_written(monkeypatch: pytest.MonkeyPatch) -> None:
    """The value of a forwarded variable is in the submitting shell: neither the script, nor the plan, nor the
    submitit parameters may carry it; only its name travels (sbatch --export)."""
    from hpc_train.login.slurm.executors import submitit_parameters

    monkeypatch.setenv("WANDB_API_KEY", "secret-value-123")
    job = {"job": {"nodes": 1, "tasks_per_node": 2, "forward_env": ["WANDB_API_KEY", "HOME"]}}
    plan = plan_for("local-slurm", job)
    text = render_script(plan, "srun").text
    params = submitit_parameters(plan)
    assert "#SBATCH --export=WANDB_API_KEY,HOME" in text
    assert params["additional_parameters"]["export"] == "WANDB_API_KEY,HOME"
    for written in (text, plan.to_json(), repr(params)):
        assert "secret-value-123" not in written


def test_gres_sites_ask_for_gres() -> None:
    from hpc_train.login.slurm.directives import sbatch_directives

    for name in SHIPPED_SITES:
        site = load_site(name)
        if site.node.gpus and site.slurm.gpu_directive == "gres":
            assert f"--gres=gpu:{site.node.gpus}" in sbatch_directives(plan_for(name), "srun")


def test_a_site_without_requeue_submits_no_requeue_and_tells_the_ranks(tmp_path: Path) -> None:
    """``[slurm] requeue = "dependency"``: the script asks for --no-requeue (requeue is not how the next attempt
    is made) and the ranks know to submit the next job themselves (hpc_train.run.chain); submitit's too."""
    import dataclasses

    from hpc_train.config.job import JobConfig
    from hpc_train.config.loader import build
    from hpc_train.config.plan import make_plan
    from hpc_train.login.slurm.executors import submitit_parameters

    base = load_site("local-slurm")
    site = dataclasses.replace(base, slurm=dataclasses.replace(base.slurm, requeue="dependency"))
    plan = make_plan(build(JobConfig, {"job": {"nodes": 2}}), site, "slurm", cwd=tmp_path)
    directives = [line for line in render_script(plan, "srun").text.splitlines() if line.startswith("#SBATCH")]
    assert "#SBATCH --no-requeue" in directives and "#SBATCH --requeue" not in directives
    assert plan.env["HPC_TRAIN_REQUEUE"] == "dependency"
    assert submitit_parameters(plan)["additional_parameters"]["no-requeue"] is True
    assert "HPC_TRAIN_REQUEUE" not in make_plan(build(JobConfig, {}), base, "slurm", cwd=tmp_path).env


def test_hot_spares_are_allocated_kept_alive_and_settled(tmp_path: Path) -> None:
    """``job.spare_nodes``: the spares are in --nodes, a lost node does not end the job (--no-kill) or the
    step (no --kill-on-bad-exit), and the script's status is what the run says of the job (--settle)."""
    from hpc_train.config.job import JobConfig
    from hpc_train.config.loader import build
    from hpc_train.config.plan import make_plan
    from hpc_train.login.slurm.executors import submitit_parameters

    cfg = build(JobConfig, {"job": {"nodes": 2, "spare_nodes": 1, "partition": "spares"}})
    plan = make_plan(cfg, load_site("local-slurm"), "slurm", cwd=tmp_path)
    text = render_script(plan, "srun").text
    directives = [line for line in text.splitlines() if line.startswith("#SBATCH")]
    assert "#SBATCH --nodes=3" in directives and "#SBATCH --no-kill" in directives
    srun = next(line for line in text.splitlines() if line.startswith("srun "))
    assert "--kill-on-bad-exit" not in srun and srun.endswith("|| status=$?")
    assert text.rstrip().splitlines()[-1].endswith(f'-m hpc_train.agent --settle {plan.run_dir} "$status"')
    result = subprocess.run(["bash", "-n"], input=text, capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr
    with pytest.raises(ConfigError, match="only the srun template starts the agents"):
        render_script(plan, "torchrun")
    with pytest.raises(ConfigError, match=r"job\.spare_nodes: submitit's job would end FAILED"):
        submitit_parameters(plan)
    for overrides, message in (({"retry": {"in_place": 0}}, "a spare is used by a restart inside the job"),
                               ({"job": {"nodes": 2, "spare_nodes": -1}}, "job.spare_nodes: -1 is below")):
        with pytest.raises(ConfigError, match=message):  # -1: refused by its range as the file is read
            bad = build(JobConfig, {"job": {"nodes": 2, "spare_nodes": 1}, **overrides})
            make_plan(bad, load_site("local-slurm"), "slurm", cwd=tmp_path)


def test_shrink_keeps_the_job_alive_without_spares_and_settles(tmp_path: Path) -> None:
    """``retry.shrink``: no node more in --nodes, but a lost node must not end the job or the step either, and
    only the srun template starts the agents that go on without it; each bad combination names the key."""
    from hpc_train.config.job import JobConfig
    from hpc_train.config.loader import build
    from hpc_train.config.plan import make_plan
    from hpc_train.login.slurm.executors import submitit_parameters

    cfg = build(JobConfig, {"job": {"nodes": 2}, "retry": {"shrink": True}})
    plan = make_plan(cfg, load_site("local-slurm"), "slurm", cwd=tmp_path)
    text = render_script(plan, "srun").text
    directives = [line for line in text.splitlines() if line.startswith("#SBATCH")]
    assert "#SBATCH --nodes=2" in directives and "#SBATCH --no-kill" in directives
    srun = next(line for line in text.splitlines() if line.startswith("srun "))
    assert "--kill-on-bad-exit" not in srun
    assert text.rstrip().splitlines()[-1].endswith(f'-m hpc_train.agent --settle {plan.run_dir} "$status"')
    with pytest.raises(ConfigError, match=r"torchrun with retry\.shrink: only the srun template"):
        render_script(plan, "torchrun")
    with pytest.raises(ConfigError, match=r"retry\.shrink: submitit's job would end FAILED"):
        submitit_parameters(plan)
    assert "--no-kill" not in render_script(make_plan(build(JobConfig, {"job": {"nodes": 2}}),
                                                      load_site("local-slurm"), "slurm", cwd=tmp_path), "srun").text
    for overrides, message in (
            ({"retry": {"in_place": 0, "shrink": True}}, "retry.shrink: with retry.in_place = 0"),
            ({"job": {"nodes": 1}, "retry": {"shrink": True}}, "retry.shrink: with job.nodes = 1"),
            ({"job": {"nodes": 2, "program": "smoke"}, "retry": {"shrink": True}},
             'retry.shrink: is the built-in trainer\'s, and job.program = "smoke"'),
            ({"job": {"nodes": 2, "tasks_per_node": 1}, "parallel": {"pipeline": 2, "order": "tp-cp-dp-pp"},
              "zero": {"stage": 1},
              "retry": {"shrink": True}},
             r"retry.shrink: no smaller number of nodes keeps tensor x pipeline x context = 2")):
        bad = build(JobConfig, {"job": {"nodes": 2}, **overrides})
        with pytest.raises(ConfigError, match=message):
            make_plan(bad, load_site("local-slurm"), "slurm", cwd=tmp_path)
    with pytest.raises(ConfigError, match=r"retry\.shrink: goes on without a lost node, and the local executor"):
        make_plan(cfg, load_site("local"), "local", cwd=tmp_path)
