"""The exporters of ``[monitor]``: Prometheus' textfile parses with prometheus_client's own parser and carries the
health flags; W&B keeps one run across attempts and each trainer step once, with the real wandb package offline;
and through a real trainer run preempted once on the local executor, both hold what the run logged."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from hpc_train.rank.runtime.export_prometheus import HEALTH_CHECKS, PrometheusExporter, exposition
from hpc_train.rank.runtime.export_wandb import STATE_FILE, WandbExporter
from hpc_train.run.files import atomic_write
from tests.conftest import REPO
from tests.rank.runtime.wandb_records import read_offline_run
from tests.rank.train.signals import attempts, signal_at_steps

LABELS = {"run": 'tiny "gpt"\nx', "job_id": "42", "node": "n1"}


def _samples(path: Path) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    found = {}
    for family in text_string_to_metric_families(path.read_text()):
        for sample in family.samples:
            extra = tuple(sorted((k, v) for k, v in sample.labels.items() if k not in LABELS))
            assert {k: sample.labels[k] for k in LABELS} == LABELS  # escaped and read back whole
            found[(sample.name, extra)] = sample.value
    return found


def test_the_textfile_parses_and_holds_the_scalars_the_breakdown_and_the_health_flags(tmp_path: Path) -> None:
    lines: list[str] = []
    exporter = PrometheusExporter(tmp_path, tmp_path, LABELS, lines.append)
    exporter.record({"step": 20, "loss": 3.25, "tokens_per_s": 1200.0, "data_ms": 40.0, "data_share": 0.4,
                     "data_ms_max": 44.0, "comm_ms": 5.0, "accuracy": 0.5, "time": 1.0})
    atomic_write(tmp_path / "health.json", json.dumps({"findings": [{"check": "data_wait"}]}))
    exporter.record({"step": 20, "eval_loss": float("nan")})
    exporter.close()
    samples = _samples(exporter.path)
    assert exporter.path.name == "hpc_train_tiny__gpt__x.prom" and lines == []
    assert samples[("hpc_train_step", ())] == 20 and samples[("hpc_train_loss", ())] == 3.25
    assert samples[("hpc_train_tokens_per_second", ())] == 1200
    assert samples[("hpc_train_step_phase_seconds", (("phase", "data"),))] == pytest.approx(0.04)
    assert samples[("hpc_train_step_phase_ratio", (("phase", "data"),))] == 0.4
    assert samples[("hpc_train_step_phase_seconds", (("phase", "comm"),))] == pytest.approx(0.005)
    assert samples[("hpc_train_metric", (("name", "accuracy"),))] == 0.5
    assert samples[("hpc_train_health_flag", (("check", "data_wait"),))] == 1
    assert {check for (name, extra), value in samples.items() if name == "hpc_train_health_flag"
            for _, check in extra} == set(HEALTH_CHECKS)
    assert sum(value for (name, _), value in samples.items() if name == "hpc_train_health_flag") == 1
    assert oct(exporter.path.stat().st_mode & 0o777) == "0o644"  # node_exporter runs as another user
    assert not any(key[0].endswith("_max") for key in samples)


def test_a_folder_reached_through_a_link_is_refused_with_one_warning(tmp_path: Path) -> None:
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    lines: list[str] = []
    exporter = PrometheusExporter(tmp_path / "link", tmp_path, LABELS, lines.append)
    exporter.record({"step": 1, "loss": 1.0})
    exporter.close()
    assert list((tmp_path / "real").iterdir()) == [] and len(lines) == 1
    assert "prometheus" in lines[0] and "goes on" in lines[0]


def _offline_runs(run_dir: Path) -> list:
    return [read_offline_run(path) for path in sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))]


def test_two_attempts_are_one_wandb_run_with_each_step_once(tmp_path: Path) -> None:
    lines: list[str] = []
    first = WandbExporter(tmp_path, "offline", "p", "", "tiny", {"train": {"lr": 0.001}}, lines.append)
    for step in range(1, 7):
        first.record({"step": step, "loss": 1 / step, "time": 0.0})
    first.close()
    second = WandbExporter(tmp_path, "offline", "p", "", "tiny", {}, lines.append)  # resumed from step 4
    for step in range(5, 10):
        second.record({"step": step, "loss": 1 / step})
    second.record({"step": 9, "eval_loss": 2.0})
    second.close()
    runs = _offline_runs(tmp_path)
    assert len(runs) == 2 and runs[0].run_id == runs[1].run_id == first.id == second.id
    steps = [row["trainer/step"] for run in runs for row in run.history if "loss" in row]
    assert steps == list(range(1, 10))  # 5 and 6 were the first attempt's, sent once
    assert any(row.get("eval_loss") == 2.0 for row in runs[1].history)
    assert json.loads((tmp_path / STATE_FILE).read_text()) == {"id": first.id, "last_step": 9}
    assert lines[-1].startswith(f"wandb: run {first.id} (offline, continuing from step 6)")
    assert not any(path.is_symlink() for path in tmp_path.rglob("*"))  # no link inside a run folder


def test_a_wandb_failure_is_one_warning_and_training_goes_on(tmp_path: Path) -> None:
    (tmp_path / "wandb").write_text("not a folder")  # W&B cannot make its folder: wandb.init fails for real
    lines: list[str] = []
    exporter = WandbExporter(tmp_path, "offline", "p", "", "tiny", {}, lines.append)
    exporter.record({"step": 1, "loss": 1.0})  # neither raises
    exporter.close()
    assert len(lines) == 1 and lines[0].startswith("warning: wandb:") and "training goes on" in lines[0], lines
    assert exporter.run is None


@pytest.mark.slow
def test_a_preempted_trainer_run_exports_one_wandb_run_and_a_prometheus_file(tmp_path: Path) -> None:
    steps = 30
    job = tmp_path / "job.toml"
    job.write_text('[job]\nname = "exported"\ntasks_per_node = 2\n[train]\nsteps = 30\nseq_len = 32\n'
                   'micro_batch = 4\nprecision = "fp32"\n[monitor]\nlog_every = 2\neval_every = 10\n'
                   'tensorboard = false\nwandb = "offline"\nprometheus = true\n[checkpoint]\nevery_steps = 4\n'
                   '[env]\nHPC_TRAIN_INJECT_FAULT = "slow:1:60"\n')  # a step of about 0.1 s: time to signal
    process = subprocess.Popen([sys.executable, "-m", "hpc_train.submit", str(job), "--site", "local"], cwd=tmp_path,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               env={**os.environ, "WANDB_MODE": "offline"})
    run_dir = tmp_path / "runs" / "exported"
    try:
        signal_at_steps(process, run_dir, [11])
        output, _ = process.communicate(timeout=300)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 0, output[-4000:]
    runs = attempts(run_dir)
    assert [a["outcome"] for a in runs] == ["preempted", "completed"], runs
    assert runs[1]["start_step"] == runs[0]["end_step"], runs  # saved where it stopped (replays: the test above)
    offline = _offline_runs(run_dir)
    assert len(offline) == 2 and offline[0].run_id == offline[1].run_id
    logged = [row["trainer/step"] for run in offline for row in run.history if "loss" in row]
    assert logged == list(range(2, steps + 1, 2)), logged  # the replayed steps once, none lost
    evals = [row["trainer/step"] for run in offline for row in run.history if "eval_loss" in row]
    assert evals == [10, 20, 30], evals
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families((run_dir / "hpc_train_exported.prom").read_text())
               for s in family.samples}
    labels = (("job_id", "local"),)
    assert any(name == "hpc_train_step" and value == steps and labels[0] in key for (name, key), value in
               samples.items())
    assert {dict(key)["check"] for name, key in samples if name == "hpc_train_health_flag"} >= set(HEALTH_CHECKS)
    assert not any(path.is_symlink() for path in run_dir.rglob("*"))
    sent = max(row["trainer/step"] for row in offline[0].history if "loss" in row)  # the first attempt's last
    assert sent <= runs[0]["end_step"] and f"wandb: run {offline[0].run_id} (offline, continuing from step {sent})" \
        in output  # (it stops where the ranks agree, a logged step or not)


def test_the_grafana_dashboard_reads_only_metrics_the_exporter_writes_one_row_per_run() -> None:
    dashboard = json.loads((REPO / "docs" / "grafana" / "hpc_train_dashboard.json").read_text())
    full = {"step": 1, "loss": 1.0, "eval_loss": 1.0, "lr": 1.0, "grad_norm": 1.0, "tokens_per_s": 1.0, "mfu": 0.1,
            "step_time_s": 0.1, "memory_bytes": 1.0, **{f"{p}_{k}": 1.0 for p in ("data", "forward", "backward",
                                                                                 "optimizer", "comm")
                                                       for k in ("ms", "share")}}
    written = {family.name for family in text_string_to_metric_families(
        exposition(LABELS, full, dict.fromkeys(HEALTH_CHECKS, False), 0.0))}
    exprs = [target["expr"] for panel in dashboard["panels"] for target in panel.get("targets", [])]
    used = {name for expr in exprs for name in re.findall(r"hpc_train_[a-z_]+", expr)}
    assert used and used <= written, used - written
    assert all('run="$run"' in expr for expr in exprs)
    rows = [panel for panel in dashboard["panels"] if panel["type"] == "row"]
    assert [row["repeat"] for row in rows] == ["run"]
    variable = {v["name"]: v for v in dashboard["templating"]["list"]}["run"]
    assert variable["multi"] and "label_values(hpc_train_step, run)" in variable["definition"]
