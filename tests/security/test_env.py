"""[env], --set env.* and a site's [env]: names that run code or steer Slurm, and credentials, are refused.

Why: the job's environment is exported by every rendered script and submitit's setup lines before bash, the
loader, Python and srun read their own variables, and it is written into plan.json: a config copied from someone
else must not run code through BASH_ENV or LD_PRELOAD, and a token must never land on a shared file system.
"""

from __future__ import annotations

import json

import pytest

from tests.security.harness import Case, World, across, cases_ids, on, q, run_case, site_toml

# Names that make the shell, the loader, Python, MPI, torch or Slurm do something the plan does not show.
REFUSED = [
    ("BASH_ENV", "@PAYLOAD@"), ("ENV", "@PAYLOAD@"), ("LD_PRELOAD", "@ROOT@/evil.so"),
    ("LD_LIBRARY_PATH", "@ROOT@/lib"), ("LD_AUDIT", "@ROOT@/audit.so"), ("PYTHONPATH", "@ROOT@"),
    ("PYTHONSTARTUP", "@PAYLOAD@"), ("PYTHONHOME", "@ROOT@"), ("PYTHONINSPECT", "1"),
    ("SRUN_CPUS_PER_TASK", "64"), ("SBATCH_EXPORT", "ALL"), ("SLURM_CONF", "@ROOT@/slurm.conf"),
    ("OMPI_MCA_plm", "rsh"), ("OMPI_MCA_plm_rsh_agent", "@PAYLOAD@"), ("PROMPT_COMMAND", "touch @CANARY@"),
    ("IFS", "x"), ("PS4", "$(touch @CANARY@)"), ("SHELLOPTS", "xtrace"), ("BASHOPTS", "extdebug"),
    ("GLIBC_TUNABLES", "glibc.malloc.check=3"), ("MALLOC_CONF", "x"), ("MALLOC_CHECK_", "3"),
    ("MALLOC_PERTURB_", "42"), ("PMIX_MCA_mca_base_component_path", "@ROOT@"), ("PMIX_MCA_gds", "hash"),
    ("PRTE_MCA_plm", "ssh"), ("TORCHELASTIC_ERROR_FILE", "@VICTIM@/precious.txt"), ("TORCHELASTIC_RUN_ID", "x"),
    ("PATH", "@ROOT@/bin"), ("HOME", "@ROOT@"), ("CDPATH", "@ROOT@"), ("DYLD_INSERT_LIBRARIES", "x.dylib"),
    ("PERL5OPT", "-Mevil"), ("NODE_OPTIONS", "--require=@PAYLOAD@"), ("GCONV_PATH", "@ROOT@"),
    ("PYTHONBREAKPOINT", "os.system"), ("PYTHONWARNINGS", "error"), ("NCCL_NET_PLUGIN", "@ROOT@/p.so"),
    ("SBATCH_PARTITION", "urgent"), ("SALLOC_ACCOUNT", "other"), ("MASTER_ADDR", "evil.example"),
    ("HPC_TRAIN_RUN_DIR", "@VICTIM@"),
]
SET_VIA_CLI = ("BASH_ENV", "LD_PRELOAD", "PYTHONSTARTUP", "PATH", "SBATCH_EXPORT", "IFS", "TORCHELASTIC_RUN_ID")
IN_SITE = ("BASH_ENV", "LD_PRELOAD", "PYTHONPATH", "OMPI_MCA_plm", "SLURM_CONF", "PROMPT_COMMAND", "PATH")
ON_RENDER = ("BASH_ENV", "ENV", "LD_PRELOAD", "PROMPT_COMMAND", "PS4", "PYTHONSTARTUP")
ON_SUBMIT = ("BASH_ENV", "LD_PRELOAD", "PYTHONPATH", "SRUN_CPUS_PER_TASK")

SECRET_NAMES = ["GITHUB_PAT", "HF_TOKEN", "WANDB_API_KEY", "AWS_SECRET_ACCESS_KEY", "DB_PASSWORD", "MY_SECRET",
                "OPENAI_API_KEY", "NPM_TOKEN", "SLACK_BOT_TOKEN", "GH_PAT"]
# Shapes of credentials under an innocent name; each value is unique so a grep finds exactly it.
SECRET_VALUES = [
    ("ghp", "ghp_R2d2C3poQ8x7Zk1LmN0pQrStUvWxYz012345"), ("github-pat", "github_pat_11ABCDEFG0abcdefghijklmn"),
    ("hf", "hf_QwErTyUiOpAsDfGhJkLzXcVbNm123456"), ("sk", "sk-proj-abcdefghijklmnopqrstuv0123"),
    ("xoxb", "xoxb-123456789012-abcdefghijklmnop"), ("akia", "AKIAIOSFODNN7EXAMPLE"),
    ("glpat", "glpat-xY9zAbCdEfGhIjKlMnOp"), ("ssh-key", "-----BEGIN OPENSSH PRIVATE KEY-----b3BlbnNzaC1rZXk"),
    ("url-password", "https://alice:hunter2sekret@git.example.org/x"),
]


def _env(name: str, value: str) -> str:
    return f"[env]\n{q(name)} = {q(value)}\n"


def _refused_cases() -> list[Case]:
    cases = [on("dry", f"env-{name}", _env(name, value), says=(name,)) for name, value in REFUSED]
    cases += [on("dry", f"set-env-{name}", "", "--set", f"env.{name}=@PAYLOAD@", says=(name,))
              for name in SET_VIA_CLI]
    cases += [on("render", f"site-env-{name}", "", site=site_toml({f"env.{name}": q("@PAYLOAD@")}), says=(name,))
              for name in IN_SITE]
    values = dict(REFUSED)
    cases += [on("render", f"env-{name}-render", _env(name, values[name]), says=(name,)) for name in ON_RENDER]
    cases += [on("submit", f"env-{name}-submit", _env(name, values[name]), says=(name,)) for name in ON_SUBMIT]
    return cases


def _allowed_cases() -> list[Case]:
    unbuffered = _env("PYTHONUNBUFFERED", "1")
    return [
        *across("dry render submit", "env-PYTHONUNBUFFERED", unbuffered, expect=0),
        on("dry", "forward-env-secret-name-is-fine", '[job]\nforward_env = ["HF_TOKEN", "WANDB_API_KEY"]\n',
           expect=0, shows=("HF_TOKEN",)),
    ]


def _secret_cases() -> list[Case]:
    cases = [on("dry", f"secret-name-{name}", _env(name, f"v4lue-of-{name.lower()}-0x5eed"), says=(name,),
                leak=f"v4lue-of-{name.lower()}-0x5eed") for name in SECRET_NAMES]
    cases += [on("render", f"secret-value-{label}", _env("FOO", value), says=("FOO",), leak=value)
              for label, value in SECRET_VALUES]
    cases += [
        on("dry", "secret-value-ghp-dry", _env("FOO", SECRET_VALUES[0][1]), says=("FOO",), leak=SECRET_VALUES[0][1]),
        on("submit", "secret-name-HF_TOKEN-submit", _env("HF_TOKEN", "hf_SubmitPathSecret0123456789"),
           says=("HF_TOKEN",), leak="hf_SubmitPathSecret0123456789"),
        on("submit", "secret-value-hf-submit", _env("FOO", "hf_SubmitValueSecret012345678"), says=("FOO",),
           leak="hf_SubmitValueSecret012345678"),
        on("render", "secret-set-env", "", "--set", "env.WANDB_API_KEY=wandbSetSecret0xdeadbeef",
           says=("WANDB_API_KEY",), leak="wandbSetSecret0xdeadbeef"),
        on("render", "secret-site-env", "", site=site_toml({"env.FOO": q("ghp_SiteSecretAbCdEfGhIjKlMn01")}),
           says=("FOO",), leak="ghp_SiteSecretAbCdEfGhIjKlMn01"),
        on("stdout", "secret-value-stdout", _env("FOO", "sk-StdoutSecretAbCdEfGhIjKl01"), says=("FOO",),
           leak="sk-StdoutSecretAbCdEfGhIjKl01"),
    ]
    return cases


WANDB_KEY = "0123456789abcdef0123456789abcdef0badc0de"
DS_LOGGERS = {"train_micro_batch_size_per_gpu": 2, "wandb": {"enabled": True, "api_key": WANDB_KEY},
              "comet": {"enabled": True, "apiKey": "c0m3t-unique-key"}}


def _ds_file(data: dict[str, object]):
    def setup(world: World) -> None:
        (world.work / "ds_config.json").write_text(json.dumps(data), encoding="utf-8")
    return setup


def _nothing_said(*secrets: str):
    """No secret printed, nor in any file but the inputs (the harness's ``leak`` knows only the TOML ones)."""
    def check(world: World, outcome: object) -> None:
        said = getattr(outcome, "out", "") + getattr(outcome, "err", "")
        assert not [secret for secret in secrets if secret in said], "a secret was printed"
        inputs = {world.work / name for name in ("job.toml", "site.toml", "ds_config.json")}
        for path in world.root.rglob("*"):
            if path not in inputs and path.is_file() and not path.is_symlink():
                data = path.read_bytes()
                assert not [s for s in secrets if s.encode() in data], f"a secret is written in {path.name}"
    return check


def _ds_secret_cases() -> list[Case]:
    """A logger's key in ds_config.json (or the [deepspeed] table): "<redacted>" in the plan, on the screen and
    in every file written, whichever command and however the file is named."""
    named = '[train]\ndeepspeed_config = "ds_config.json"\n'
    fields = {"setup": _ds_file(DS_LOGGERS), "expect": 0, "warns": (r"wandb\.api_key",),
              "check": _nothing_said(WANDB_KEY, "c0m3t-unique-key")}
    return [
        on("dry", "secret-ds-config-dry-json", named, "--json", **fields),
        on("validate", "secret-ds-config-validate-json", named, "--json", **fields),
        on("render", "secret-ds-config-render", named, **fields),
        on("stdout", "secret-ds-config-stdout", named, **fields),
        on("dry", "secret-ds-config-by-set", "", "--json", "--set", "train.deepspeed_config=ds_config.json",
           **fields),
        on("render", "secret-deepspeed-table", f"[deepspeed.wandb]\nenabled = true\napi_key = {q(WANDB_KEY)}\n",
           expect=0, leak=WANDB_KEY, warns=(r"deepspeed\.wandb\.api_key",), check=_nothing_said(WANDB_KEY)),
        on("render", "secret-params", f"[params]\nhf_token = {q(WANDB_KEY)}\n", says=("params.hf_token",),
           leak=WANDB_KEY, check=_nothing_said(WANDB_KEY)),
    ]


CASES = [*_refused_cases(), *_allowed_cases(), *_secret_cases(), *_ds_secret_cases()]


@pytest.mark.parametrize("case", CASES, ids=cases_ids(CASES))
def test_hostile_environment(case: Case, world: World) -> None:
    run_case(case, world)
