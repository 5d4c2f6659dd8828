"""Every config or command-line mistake: exit status 2, one message naming the key and the fix, nothing written.

Each case runs the real ``submit`` command (not a dry run) in an empty folder: if a mistake slipped through,
a job would start and the folder would fill, and the test would fail.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hpc_train.login import main as hpc_main
from hpc_train.login import submit
from tests.conftest import call_cli

BAD_SITE = """
name = "badsite"
[node]
gpus = 4
cpus = 16
[slurm]
max_time = "04:00:00"
"""

# (case id, job TOML, extra CLI arguments, text the one message must contain)
CASES = [
    ("unknown-key", "[job]\ntaks_per_node = 2\n", [], 'job.taks_per_node: unknown key, did you mean "tasks_per_node"'),
    ("unknown-section", "[trian]\nsteps = 1\n", [], 'trian: unknown section, did you mean "train"'),
    ("data-is-derived", "[parallel]\ndata = 2\n", [], "parallel.data: is not a setting. Fix: data parallel size"),
    ("wrong-type", '[job]\nnodes = "two"\n', [], "job.nodes: expected an integer"),
    ("bool-for-int", "[job]\nnodes = true\n", [], "job.nodes: expected an integer, got True"),
    ("zero-nodes", "[job]\nnodes = 0\n", [], "job.nodes: 0 is below the minimum 1"),
    ("world-not-divisible", "[job]\nnodes = 3\ntasks_per_node = 2\n[parallel]\ntensor = 2\npipeline = 2\n", [],
     "world size 6 (= 3 nodes x 2 tasks_per_node) is not divisible by tensor x pipeline = 2 x 2"),
    ("tensor-across-nodes", "[job]\nnodes = 3\ntasks_per_node = 1\n[parallel]\ntensor = 3\n", [],
     "parallel.tensor: 3 does not divide the 1 ranks of a node"),
    ("tensor-vs-heads", "[job]\ntasks_per_node = 3\n[parallel]\ntensor = 3\n", [],
     "3 does not divide the 4 attention heads"),
    ("pipeline-too-deep", "[job]\ntasks_per_node = 4\n[parallel]\npipeline = 4\n[zero]\nstage = 1\n", [],
     "parallel.pipeline: 4 stages for the 2 layers"),
    ("zero-stage-5", "[zero]\nstage = 5\n", [], "zero.stage: 5 is not a ZeRO stage"),
    ("zero2-with-pipeline", "[job]\ntasks_per_node = 2\n[parallel]\npipeline = 2\n", [],
     "zero.stage: ZeRO-2 cannot run with pipeline = 2"),
    ("offload-params-needs-3", "[zero]\noffload_params = true\n", [], "zero.offload_params: needs ZeRO-3"),
    ("offload-optimizer-needs-cpu-adam", "[zero]\noffload_optimizer = true\n", [],
     'zero.offload_optimizer: needs train.optimizer = "cpu_adam"'),
    ("fp16-without-gpu", '[train]\nprecision = "fp16"\n', [], 'train.precision: "fp16" needs a GPU'),
    ("precision-typo", '[train]\nprecision = "bf61"\n', [], 'did you mean "bf16"'),
    ("global-batch-mismatch", "[job]\ntasks_per_node = 2\n[train]\nmicro_batch = 4\nglobal_batch = 10\n", [],
     "train.global_batch: 10 != micro_batch x grad_accum x data = 4 x 1 x 2 = 8"),
    ("every-minutes-word", '[checkpoint]\nevery_minutes = "often"\n', [],
     'checkpoint.every_minutes: expected a number or one of "auto", got \'often\''),
    ("every-minutes-negative", "[checkpoint]\nevery_minutes = -5\n", [],
     "checkpoint.every_minutes: -5.0 is below the minimum 0"),
    ("every-minutes-for-a-program", '[job]\nprogram = "smoke"\n[checkpoint]\nevery_minutes = 30\n', [],
     "checkpoint.every_minutes: is the built-in trainer's"),
    ("spare-nodes-on-this-machine", "[job]\nspare_nodes = 1\n", [],
     "job.spare_nodes: 1 spare node(s) need Slurm; the local executor runs every rank on this machine"),
    ("micro-batch-zero", "[train]\nmicro_batch = 0\n", [], "train.micro_batch: 0 is below the minimum 1"),
    ("lr-negative", "[train]\nlr = -1.0\n", [], "train.lr: -1.0 is not positive"),
    ("min-lr-above-lr", "[train]\nlr = 1e-4\nmin_lr = 1e-3\n", [], "train.min_lr: 0.001 is above lr"),
    ("warmup-longer-than-run", "[train]\nsteps = 10\nwarmup_steps = 20\n", [], "train.warmup_steps: 20 is more than"),
    ("beta-out-of-range", "[train]\nbeta2 = 1.5\n", [], "train.beta2: 1.5 is outside [0, 1)"),
    ("model-typo", '[train]\nmodel = "tinny"\n', [], 'train.model: "tinny" is not a preset, did you mean "tiny"'),
    ("model-entry-point-malformed", '[train]\nmodel = "mymodel:"\n', [],
     'train.model: "mymodel:" names no function. Fix: write "package.module:function"'),
    ("model-file-missing", '[train]\nmodel = "nets/lm.py:build"\n', [],
     'train.model: file {tmp}/nets/lm.py of "nets/lm.py:build" does not exist'),
    ("model-script-without-function", '[train]\nmodel = "lm.py"\n', [],
     'train.model: "lm.py" names no function. Fix: write "lm.py:function"'),
    ("model-module-missing", '[train]\nmodel = "no_such_pkg_xyz.nets:build"\n', [],
     'train.model: module "no_such_pkg_xyz.nets" of "no_such_pkg_xyz.nets:build" is found neither'),
    ("source-typo", '[data]\nsource = "synthetc"\n', [], 'data.source: "synthetc" is not a source, did you mean '
     '"synthetic"?'),
    ("source-file-missing", '[data]\nsource = "data.py:dataset"\n', [],
     'data.source: file {tmp}/data.py of "data.py:dataset" does not exist'),
    ("collate-malformed", '[data]\ncollate = "pad batch"\n', [], 'data.collate: "pad batch" is not a known name'),
    ("workers-negative", "[data]\nnum_workers = -1\n", [], "data.num_workers: -1 is below the minimum 0"),
    ("health-share-above-1", "[monitor]\nhealth_data_share = 1.5\n", [],
     "monitor.health_data_share: 1.5 is above 1 (a share)"),
    ("health-spike-negative", "", ["--set", "monitor.health_loss_spike=-2"],
     "monitor.health_loss_spike: -2.0 is below the minimum 0"),
    ("health-growth-string", "[monitor]\nhealth_memory_growth = \"lots\"\n", [], "monitor.health_memory_growth"),
    ("health-comm-above-1", "", ["--set", "monitor.health_comm_share=2"],
     "monitor.health_comm_share: 2.0 is above 1 (a share). Fix: give a share of the step between 0 and 1, like 0.2"),
    ("health-gpu-above-1", "[monitor]\nhealth_gpu_utilisation = 70\n", [],
     "monitor.health_gpu_utilisation: 70.0 is above 1 (a share)"),
    ("comm-sample-negative", "[monitor]\ncomm_sample_every = -1\n", [],
     "monitor.comm_sample_every: -1 is below the minimum 0"),
    ("wandb-mode-typo", '[monitor]\nwandb = "ofline"\n', [], 'monitor.wandb: "ofline" is not valid'),
    ("engine-typo", '[train]\nengine = "fsdp"\n', [], 'train.engine: "fsdp" is not valid'),
    ("zero-key-with-fsdp2", '[train]\nengine = "fsdp2"\n[zero]\nstage = 3\n', [],
     'zero.stage: is DeepSpeed\'s; train.engine = "fsdp2" shards parameters, gradients and optimizer state by '
     "itself (ZeRO-3's layout). Fix: remove zero.stage (offload is fsdp.offload)"),
    ("deepspeed-table-with-fsdp2", '[train]\nengine = "fsdp2"\n[deepspeed]\nwall_clock_breakdown = true\n', [],
     'deepspeed.wall_clock_breakdown: is a DeepSpeed config key; train.engine = "fsdp2" does not read it'),
    ("pipeline-with-fsdp2", '[job]\ntasks_per_node = 2\n[train]\nengine = "fsdp2"\n[parallel]\npipeline = 2\n',
     [], 'parallel.pipeline: 2 with train.engine = "fsdp2": FSDP2 here shards over the data axis, with tensor '
     'parallelism beside it'),
    ("fused-adam-with-fsdp2", '[train]\nengine = "fsdp2"\noptimizer = "fused_adam"\n', [],
     'train.optimizer: "fused_adam" is a DeepSpeed op; FSDP2 trains with torch\'s AdamW'),
    ("compile-with-zero3", "[train]\ncompile = true\n[zero]\nstage = 3\n", [],
     'train.compile: with zero.stage = 3: ZeRO-3 gathers each parameter in hooks inside the compiled blocks. '
     'Fix: use train.engine = "fsdp2"'),
    ("compile-with-pipeline", "[job]\ntasks_per_node = 2\n[train]\ncompile = true\n[parallel]\npipeline = 2\n",
     [], "train.compile: with parallel.pipeline = 2: DeepSpeed's pipeline engine runs the layers itself"),
    ("compile-backend-without-compile", '[train]\ncompile_backend = "aot_eager"\n', [],
     'train.compile_backend: "aot_eager" is set but train.compile is false, so nothing is compiled. '
     "Fix: set train.compile = true"),
    ("compile-in-a-program", '[job]\nprogram = "smoke"\n[train]\ncompile = true\n', [],
     'train.compile: is the built-in trainer\'s, and job.program = "smoke". Fix: remove it'),
    ("compile-backend-typo", '[train]\ncompile = true\ncompile_backend = "inducter"\n', [],
     'train.compile_backend: "inducter" is not valid'),
    ("fsdp-key-with-deepspeed", "[fsdp]\noffload = true\n", [],
     'fsdp.offload: is for train.engine = "fsdp2"; this job trains with DeepSpeed. Fix: set train.engine = "fsdp2"'),
    ("wandb-project-space", '[monitor]\nwandb_project = "my project"\n', [],
     "monitor.wandb_project: 'my project' is not a W&B name"),
    ("prometheus-not-bool", '[monitor]\nprometheus = "yes"\n', [], "monitor.prometheus"),
    ("prefetch-without-workers", "[data]\nprefetch_factor = 4\n", [],
     "data.prefetch_factor: 4 needs worker processes, but data.num_workers = 0. Fix: set data.num_workers to 1"),
    ("persistent-without-workers", "[data]\npersistent_workers = true\n", [],
     "data.persistent_workers: True needs worker processes, but data.num_workers = 0"),
    ("parameters-negative", "[train]\nparameters = -5\n", [], "train.parameters: -5 is below the minimum 0"),
    ("tokens-without-path", '[data]\nsource = "tokens"\n', [], 'data.path: is empty but data.source = "tokens"'),
    ("keep-zero", "[checkpoint]\nkeep = 0\n", [], "checkpoint.keep: 0 is below the minimum 1"),
    ("time-format", '[job]\ntime = "1 hour"\n', [], "job.time: '1 hour' is not a Slurm time limit"),
    ("time-too-short", '[job]\ntime = "00:00:30"\n', [], "job.time: '00:00:30' is under one minute"),
    ("lead-longer-than-job", '[job]\ntime = "00:01:30"\n[preempt]\nlead_seconds = 120\n', [],
     "preempt.lead_seconds: 120 s is not shorter than job.time"),
    ("lead-under-slack", "[preempt]\nlead_seconds = 10\n", [], "less than Slurm's 60 s delivery slack"),
    ("signal-usr1", '[preempt]\nsignal = "USR1"\n', [], "preempt.signal: USR1 is used by NCCL"),
    ("name-newline", '[job]\nname = "x\\ntouch /tmp/pwned"\n', [], "job.name: holds the control character '\\n' "
     "('x\\ntouch /tmp/pwned')"),
    ("name-command-substitution", '[job]\nname = "$(id)"\n', [], "job.name: '$(id)' is not allowed"),
    ("partition-semicolon", '[job]\npartition = "gpu;id"\n', [], "job.partition: 'gpu;id' is not allowed"),
    ("mem-format", '[job]\nmem = "lots"\n', [], "job.mem: 'lots' is not a Slurm memory size"),
    ("exclude-format", '[job]\nexclude = "node 1"\n', [], "job.exclude: 'node 1' is not a Slurm host list"),
    ("run-root-space", '[job]\nrun_root = "/tmp/my runs"\n', [], "job.run_root: '/tmp/my runs' has characters"),
    ("env-bad-name", '[env]\n"1BAD" = "x"\n', [], "env.1BAD: '1BAD' is not a valid environment variable name"),
    ("env-secret", '[env]\nHF_TOKEN = "hf_abc"\n', [], 'env.HF_TOKEN: looks like a secret'),
    ("env-value-newline", '[env]\nA = "x\\ny"\n', [], "env.A: holds the control character '\\n' ('x\\ny')"),
    ("gpus-on-cpu-site", "[job]\ngpus_per_node = 1\n", [], "job.gpus_per_node: 1 GPUs asked for, but site local"),
    ("forward-env-all", '[job]\nforward_env = ["ALL"]\n', [], 'job.forward_env: "ALL" is an sbatch --export keyword'),
    ("env-reserved", '[env]\nMASTER_ADDR = "10.0.0.1"\n', [], "env.MASTER_ADDR: is set by the launcher"),
    ("env-slurm-variable", '[env]\nSLURM_NTASKS = "4"\n', [], "env.SLURM_NTASKS: changes what Slurm does"),
    ("env-secret-value", '[env]\nHF_HOME_X = "hf_abcdefghijklmnop"\n', [], "env.HF_HOME_X: looks like a secret"),
    ("env-password-in-url", '[env]\nDB = "postgres://me:pw@db/x"\n', [], "env.DB: looks like a secret"),
    ("lr-nan", "[train]\nlr = nan\n", [], "train.lr: nan is not a finite number"),
    ("lr-inf", "[train]\nlr = inf\n", [], "train.lr: inf is not a finite number"),
    ("context-vs-seq", "[job]\ntasks_per_node = 3\n[parallel]\ncontext = 3\n", [],
     "train.seq_len: 128 is not divisible by context = 3"),
    ("order-bad", '[parallel]\norder = "tp-dp-pp"\n', [], "parallel.order: order 'tp-dp-pp' must name each"),
    ("sweep-env", "", ["--sweep", "env.X=a,b"], "--sweep env.X=a,b: the runs of a sweep are one job array"),
    ("sweep-without-values", "", ["--sweep", "train.lr"], "--sweep train.lr: expected SECTION.KEY=V1,V2"),
    ("deepspeed-conflict", "[deepspeed]\nzero_optimization = { stage = 3 }\n", [],
     "deepspeed.zero_optimization.stage: 3 conflicts with 2 from the typed config"),
    ("toml-syntax", "[job\nnodes = 1\n", [], "not valid TOML"),
    ("set-without-equals", "", ["--set", "train.lr"], "--set train.lr: expected SECTION.KEY=VALUE"),
    ("set-unknown-key", "", ["--set", "train.lrr=1"], 'unknown key "train.lrr", did you mean "train.lr"'),
    ("set-unknown-section", "", ["--set", "trian.lr=1"], 'unknown section "trian", did you mean "train"'),
    ("set-wrong-type", "", ["--set", "train.steps=many"], "train.steps: expected an integer, got 'many'"),
    ("site-unknown", "", ["--site", "locall"], 'no site named "locall", did you mean "local"'),
    ("executor-slurm-on-local-site", "", ["--executor", "slurm"], "--executor: slurm, but "),
    ("executor-bad-choice", "", ["--executor", "cloud"], "argument --executor: invalid choice"),
    ("gpus-over-node", "[job]\ngpus_per_node = 8\n", ["--site", "@bad"],
     "job.gpus_per_node: 8 is more than the 4 GPUs"),
    ("ranks-over-gpus", "[job]\ntasks_per_node = 8\ngpus_per_node = 4\n", ["--site", "@bad"],
     "job.tasks_per_node: 8 ranks per node but 4 GPUs"),
    ("cpus-over-node", "[job]\ntasks_per_node = 4\ncpus_per_task = 8\n", ["--site", "@bad"],
     "job.cpus_per_task: 8 x 4 tasks_per_node = 32 cores, but a badsite node has 16"),
    ("time-over-site-limit", '[job]\ntime = "1-00:00:00"\n', ["--site", "@bad"],
     'job.time: "1-00:00:00" is longer than the badsite limit "04:00:00"'),
]


@pytest.mark.parametrize(("toml", "extra", "message"), [case[1:] for case in CASES], ids=[c[0] for c in CASES])
def test_bad_input_exits_2_with_one_clear_message_and_writes_nothing(
    tmp_path: Path, toml: str, extra: list[str], message: str
) -> None:
    config = tmp_path / "job.toml"
    config.write_text(toml, encoding="utf-8")
    (tmp_path / "bad.toml").write_text(BAD_SITE, encoding="utf-8")
    extra = [str(tmp_path / "bad.toml") if arg == "@bad" else arg for arg in extra]
    if "--site" not in extra:
        extra = ["--site", "local", *extra]
    if "--executor" not in extra:
        extra += ["--executor", "local"]
    before = sorted(p.name for p in tmp_path.iterdir())
    result = call_cli(submit.main, [str(config), *extra], tmp_path)
    assert result.code == 2, result.out + result.err
    assert message.format(tmp=tmp_path) in result.err, result.err
    assert result.err.count("error:") == 1 and result.out == ""
    assert "Traceback" not in result.err
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # nothing written, no run folder


def test_at_least_thirty_cases() -> None:
    assert len(CASES) >= 30


@pytest.mark.parametrize("command", ["validate", "render"])
def test_other_commands_share_the_rule(tmp_path: Path, command: str) -> None:
    config = tmp_path / "job.toml"
    config.write_text("[job]\nnodes = 0\n", encoding="utf-8")
    result = call_cli(hpc_main.main, [command, str(config), "--site", "local-slurm"], tmp_path)
    assert result.code == 2 and "job.nodes: 0 is below the minimum 1" in result.err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["job.toml"]


def test_render_out_to_a_folder_writes_nothing(tmp_path: Path) -> None:
    config = tmp_path / "job.toml"
    config.write_text("", encoding="utf-8")
    result = call_cli(hpc_main.main, ["render", str(config), "--site", "local-slurm", "--out", str(tmp_path)],
                      tmp_path)
    assert result.code == 2 and "--out: " in result.err and "is a folder" in result.err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["job.toml"]


def test_missing_config_file(tmp_path: Path) -> None:
    result = call_cli(submit.main, [str(tmp_path / "nope.toml"), "--dry-run"], tmp_path)
    assert result.code == 2 and "config file not found" in result.err


SITE_CASES = [
    ("pyxis-without-python", '[container]\nruntime = "pyxis"\nimage = "nvcr.io#nvidia/pytorch:24.11-py3"\n',
     "software.python: is empty, but ranks run inside a pyxis container"),
    ("site-env-secret", '[env]\nWANDB_API_KEY = "abc"\n', "env.WANDB_API_KEY: looks like a secret"),
    ("nccl-table-other-variable", '[network.nccl]\nOMP_NUM_THREADS = "4"\n', "is not an NCCL variable"),
    ("container-without-image", '[container]\nruntime = "apptainer"\n', 'container.image: is empty but runtime'),
    ("srun-arg-two-flags", '[launch]\nsrun_args = ["--mpi=pmi2 --exclusive"]\n', "is not a single srun flag"),
    ("port-range-reversed", "[launch]\nport_range = [30000, 20000]\n", "launch.port_range: [30000, 20000]"),
    ("hca-with-space", '[network]\ninterconnect = "ib"\nhcas = ["mlx5 0"]\n', "is not an RDMA device"),
    ("site-unknown-key", "[node]\ngpu = 4\n", 'node.gpu: unknown key, did you mean "gpus"'),
]


@pytest.mark.parametrize(("site_text", "message"), [c[1:] for c in SITE_CASES], ids=[c[0] for c in SITE_CASES])
def test_bad_site_exits_2_naming_the_site_key(tmp_path: Path, site_text: str, message: str) -> None:
    (tmp_path / "job.toml").write_text("", encoding="utf-8")
    site = tmp_path / "mysite.toml"
    site.write_text('[slurm]\nenabled = false\n' + site_text, encoding="utf-8")
    result = call_cli(submit.main, [str(tmp_path / "job.toml"), "--site", str(site), "--executor", "local"], tmp_path)
    assert result.code == 2, result.out + result.err
    assert message in result.err and "site " in result.err, result.err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["job.toml", "mysite.toml"]


def test_validate_memory_sizes_a_user_model_only_from_its_parameter_count(tmp_path: Path) -> None:
    """The login node never imports the user's model: without ``train.parameters`` it says how to plan it."""
    (tmp_path / "lm.py").write_text("raise SystemExit('imported on the login node')\n")
    config = tmp_path / "job.toml"
    config.write_text('[job]\ntasks_per_node = 2\n[train]\nmodel = "lm.py:build"\n', encoding="utf-8")
    args = ["validate", str(config), "--site", "local", "--memory"]
    result = call_cli(hpc_main.main, args, tmp_path)
    assert result.code == 2 and "train.parameters: the login node cannot size your model" in result.err, result.err
    assert "set [train] parameters = N" in result.err
    sized = call_cli(hpc_main.main, [*args, "--set", "train.parameters=1000000", "--json"], tmp_path)
    assert sized.code == 0, sized.err
    plan = json.loads(sized.out)
    assert plan["params_per_rank"] == 1_000_000 and plan["activations"] == 0
    assert plan["optimizer_state"] == 12 * 500_000  # ZeRO-2 over 2 ranks: fp32 master, m, v of half
    assert any("train.parameters = 1,000,000" in note for note in plan["notes"])
