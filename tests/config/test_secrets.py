"""The one rule for credentials (hpc_train.config.secrets): what it calls a secret, what it leaves alone, and
where a secret found goes (refused, or "<redacted>" in DeepSpeed's sections and never given to DeepSpeed)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hpc_train.config.deepspeed import deepspeed_config
from hpc_train.config.plan import load_job
from hpc_train.config.secrets import REDACTED, redact, secret_name, secret_reason
from hpc_train.errors import ConfigError
from hpc_train.login import main as hpc_main
from hpc_train.login import submit as hpc_submit
from tests.conftest import call_cli

WANDB_KEY = "0123456789abcdef0123456789abcdef01234567"  # a W&B key: 40 hex characters, a secret by its name only
GHP = "ghp_R2d2C3poQ8x7Zk1LmN0pQrStUvWxYz012345"


@pytest.mark.parametrize("name", ["api_key", "apiKey", "APIKey", "token", "hf_token", "HF_TOKEN", "password",
                                  "passwd", "client_secret", "credentials", "WANDB_API_KEY", "GH_PAT",
                                  "AWS_SECRET_ACCESS_KEY", "private_key", "auth_token", "session_id"])
def test_names_of_credentials(name: str) -> None:
    assert secret_name(name)


@pytest.mark.parametrize("name", ["pad_token", "eos_token", "max_tokens", "tokenizer", "TOKENIZERS_PARALLELISM",
                                  "sort_key", "key", "monkey", "author", "PATHWAY", "HF_HOME", "keep",
                                  "use_auth_token_file_path", "stage3_max_live_parameters", "experiment_key"])
def test_ordinary_names(name: str) -> None:
    assert not secret_name(name)


@pytest.mark.parametrize("value", [GHP, "hf_QwErTyUiOpAsDfGhJkLzXcVbNm123456", "sk-proj-abcdefghijklmnopqrstuv0123",
                                   "AKIAIOSFODNN7EXAMPLE", "glpat-xY9zAbCdEfGhIjKlMnOp",
                                   "https://alice:hunter2@git.example.org/x", "Qz7kP2mX9vL4nR8tW3yB6cF1hJ5dG0sA",
                                   "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxIn0.x", "wandb_v1_Ab3dE6gH9jK2mN5pQ8sT"])
def test_values_shaped_like_credentials(value: str) -> None:
    assert secret_reason("x", value)


@pytest.mark.parametrize("value", ["/scratch/users/alice/Projects2024/gpt2Large/run1/checkpoints",
                                   "meta-llama/Llama-2-7b-hf", "EleutherAI/gpt-neox-20b", "hf_transfer",
                                   "hf_dataset_name", "sk-learn", "npm_config_cache", "wandb_offline",
                                   "a" * 64, WANDB_KEY, "2f1e8a9c-7d3b-4e5f-9a1b-2c3d4e5f6a7b", "cosine", "auto",
                                   "ThisIsMyVeryLongCamelCaseModelName2"])
def test_ordinary_values(value: str) -> None:
    assert secret_reason("model", value) is None


def test_redact_reaches_every_depth_and_keeps_what_is_no_secret() -> None:
    found: list[str] = []
    data = {"wandb": {"enabled": True, "api_key": WANDB_KEY}, "comet": {"apiKey": "x", "workspace": "me"},
            "csv_monitor": {"output_path": "/x", "note": GHP}, "credentials": {"user": "u"}, "use_auth_token": True}
    assert redact(data, found=found) == {
        "wandb": {"enabled": True, "api_key": REDACTED}, "comet": {"apiKey": REDACTED, "workspace": "me"},
        "csv_monitor": {"output_path": "/x", "note": REDACTED}, "credentials": REDACTED, "use_auth_token": True}
    assert sorted(found) == ["comet.apiKey", "credentials", "csv_monitor.note", "wandb.api_key"]


def _job(tmp_path: Path, extra: str = "", ds: dict[str, object] | None = None) -> Path:
    if ds is not None:
        (tmp_path / "ds_config.json").write_text(json.dumps(ds))
    job = tmp_path / "job.toml"
    job.write_text(f'[job]\nrun_root = "{tmp_path}/runs"\n' + ("[train]\ndeepspeed_config = \"ds_config.json\"\n"
                                                               if ds is not None else "") + extra)
    return job


LOGGERS = {"train_micro_batch_size_per_gpu": 2, "wandb": {"enabled": True, "project": "p", "api_key": WANDB_KEY},
           "comet": {"enabled": True, "api_key": "c0m3tK3y-unique"}, "csv_monitor": {"enabled": True, "token": GHP}}


@pytest.mark.parametrize("argv", [["validate", "--json"], ["submit", "--dry-run", "--json", "--executor", "local"],
                                  ["validate"]])
def test_a_logger_key_in_ds_config_is_never_printed(tmp_path: Path, argv: list[str]) -> None:
    job = _job(tmp_path, ds=LOGGERS)
    entry = hpc_main.main
    result = call_cli(entry, [argv[0], str(job), "--site", "local", *argv[1:]], tmp_path)
    assert result.code == 0, result.err
    for secret in (WANDB_KEY, "c0m3tK3y-unique", GHP):
        assert secret not in result.out + result.err
    assert "wandb.api_key: looks like a credential" in result.err
    assert 'job.forward_env = ["WANDB_API_KEY"]' in result.err
    if "--json" in argv:
        printed = json.loads(result.out)
        config = (printed.get("plan") or printed)["config"]
        assert config["deepspeed"]["wandb"] == {"enabled": True, "project": "p", "api_key": REDACTED}
    assert not (tmp_path / "runs").exists()


def test_deepspeed_gets_no_placeholder(tmp_path: Path) -> None:
    cfg = load_job(_job(tmp_path, ds=LOGGERS), [])
    ds = deepspeed_config(cfg, 1)
    assert ds["wandb"] == {"enabled": True, "project": "p"} and ds["comet"] == {"enabled": True}
    assert REDACTED not in json.dumps(ds)


@pytest.mark.parametrize(("extra", "says"), [
    ('[params]\nhf_token = "abc-unique-value"\n', "params.hf_token: looks like a secret"),
    (f'[params]\nrepo = "{GHP}"\n', "params.repo: looks like a secret"),
    (f'[monitor]\nwandb_entity = "{GHP}"\n', "monitor.wandb_entity: looks like a secret"),
    ('[env]\nHF_TOKEN = "abc-unique-value"\n', "env.HF_TOKEN: looks like a secret"),
])
def test_a_secret_the_job_would_need_is_refused_without_saying_it(tmp_path: Path, extra: str, says: str) -> None:
    result = call_cli(hpc_main.main, ["validate", str(_job(tmp_path, extra)), "--site", "local"], tmp_path)
    assert result.code == 2 and says in result.err, result.err
    assert "abc-unique-value" not in result.err and GHP not in result.err


@pytest.mark.parametrize(("args", "says"), [('["--api-key", "abc-unique-value"]', "job.args[1]: looks like a secret"),
                                           ('["--token=abc-unique-value"]', "job.args[0]: looks like a secret")])
def test_a_secret_in_program_arguments_is_refused(tmp_path: Path, args: str, says: str) -> None:
    job = tmp_path / "job.toml"
    job.write_text(f'[job]\nargs = {args}\n')
    result = call_cli(hpc_main.main, ["validate", str(job), "--site", "local"], tmp_path)
    assert result.code == 2 and says in result.err and "abc-unique-value" not in result.err, result.err


def test_tokenizer_names_are_no_secrets(tmp_path: Path) -> None:
    job = _job(tmp_path, '[env]\nTOKENIZERS_PARALLELISM = "false"\n[params]\npad_token = "<pad>"\nmax_tokens = 5\n')
    cfg = load_job(job, [])
    assert cfg.env["TOKENIZERS_PARALLELISM"] == "false" and cfg.params["pad_token"] == "<pad>"  # noqa: S105


def test_set_never_echoes_a_secret(tmp_path: Path) -> None:
    job = _job(tmp_path)
    result = call_cli(hpc_submit.main, [str(job), "--dry-run", "--set", f"nope.api_key={GHP}"], tmp_path)
    assert result.code == 2 and GHP not in result.err and "<redacted>" in result.err, result.err
    with pytest.raises(ConfigError) as caught:
        load_job(job, [f"job.name={GHP}"])
    assert GHP not in str(caught.value)


def test_a_secret_with_a_control_character_is_not_echoed(tmp_path: Path) -> None:
    job = _job(tmp_path, f'[params]\nrepo = "{GHP}\\u001b"\n')
    with pytest.raises(ConfigError) as caught:
        load_job(job, [])
    assert GHP not in str(caught.value)


def test_a_secret_given_as_the_ds_config_path_is_not_echoed(tmp_path: Path) -> None:
    """Fuzzer finding (seed 7, case 1432): --set train.deepspeed_config=TOKEN was read as a path before the
    overrides were screened, and "TOKEN does not exist" printed it."""
    job = _job(tmp_path)
    result = call_cli(hpc_main.main, ["validate", str(job), "--set", f"train.deepspeed_config={GHP}"], tmp_path)
    assert result.code == 2 and GHP not in result.err and "train.deepspeed_config: looks like a secret" in result.err


@pytest.mark.parametrize(("name", "value"), [
    ("eod_token", 50256), ("eot_token", "<|eot_id|>"), ("think_token", "<think>"), ("padding_token", "<pad>"),
    ("data_pat", "shard-*.jsonl"), ("password_file", "/home/u/.pw"), ("credentials_path", "/home/u/creds.json"),
    ("hf_token_env", "HF_TOKEN"), ("dataset", "/scratch/u/hf_Datasets/c4"), ("project", "wandb_LLaMA_runs"),
    ("config_b64", "eyJsciI6IDAuMDAxLCAiYmF0Y2giOiAzMn0="), ("model", "meta-llama/Llama-2-7b-hf"),
])
def test_ordinary_values_under_ordinary_names_are_no_credentials(name: str, value: object) -> None:
    """Found by review: token ids, patterns, where a secret is kept (a file, the variable's name), dataset paths
    and project names that share a token's prefix, and a base64 config were refused as credentials."""
    from hpc_train.config.secrets import secret_reason

    assert secret_reason(name, value) is None
