"""Which [env] names a job may set and which values look like credentials: one rule, a reason per refusal."""

from __future__ import annotations

import pytest

from hpc_train.config.env_policy import refused_env_name, secret_reason


@pytest.mark.parametrize(("name", "reason"), [
    ("BASH_ENV", "shell"), ("ENV", "shell"), ("BASH_FUNC_x%%", "shell"), ("PATH", "shell"), ("IFS", "shell"),
    ("LD_PRELOAD", "loader"), ("ld_library_path", "loader"), ("GLIBC_TUNABLES", "loader"), ("MALLOC_CHECK_", "loader"),
    ("PYTHONPATH", "Python"), ("PYTHONSTARTUP", "Python"), ("SLURM_CONF", "Slurm"), ("SBATCH_EXPORT", "Slurm"),
    ("SRUN_CPUS_PER_TASK", "Slurm"), ("OMPI_MCA_plm_rsh_agent", "MPI"), ("OMPI_MCA_mca_base_component_path", "MPI"),
    ("PMIX_MCA_gds", "MPI"), ("NCCL_NET_PLUGIN", "NCCL"), ("MASTER_ADDR", "launcher"),
    ("TORCHELASTIC_RUN_ID", "launcher"),
])
def test_names_that_change_how_a_process_starts_are_refused_with_their_reason(name: str, reason: str) -> None:
    said = refused_env_name(name)
    assert said is not None and reason.lower() in said.lower(), said


@pytest.mark.parametrize("name", ["PYTHONUNBUFFERED", "OMP_NUM_THREADS", "NCCL_DEBUG", "OMPI_MCA_btl",
                                  "OMPI_ALLOW_RUN_AS_ROOT", "HF_HOME", "WANDB_PROJECT", "CUDA_LAUNCH_BLOCKING"])
def test_ordinary_names_are_taken(name: str) -> None:
    assert refused_env_name(name) is None


@pytest.mark.parametrize(("name", "value"), [
    ("GITHUB_PAT", "x"), ("GH_PAT", "x"), ("HF_TOKEN", "x"), ("WANDB_API_KEY", "x"), ("DB_PASSWORD", "x"),
    ("AWS_SECRET_ACCESS_KEY", "x"), ("FOO", "ghp_abcdefghijklmnop"), ("FOO", "glpat-abcdefghijkl"),
    ("FOO", "hf_abcdefghijklmnop"), ("FOO", "xoxb-123456789012"), ("FOO", "AKIAABCDEFGHIJKL"),
    ("FOO", "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxIn0.x"), ("FOO", "-----BEGIN OPENSSH PRIVATE KEY-----"),
    ("DB", "postgres://me:pw@db/x"),
])
def test_credentials_are_seen_by_name_and_by_shape(name: str, value: str) -> None:
    assert secret_reason(name, value) is not None


@pytest.mark.parametrize(("name", "value"), [("PATHWAY", "x"), ("HF_HOME", "/scratch/hf"), ("URL", "https://x/y"),
                                             ("MODEL", "sk")])
def test_ordinary_values_are_not_secrets(name: str, value: str) -> None:
    assert secret_reason(name, value) is None


def test_the_memory_tier_s_variables_are_the_agent_s_to_set() -> None:
    """A job's [env] cannot point its ranks at another folder of memory or another node's server."""
    from hpc_train.checkpoint.memory_store import MEMORY_ADDRESS_ENV, MEMORY_DIR_ENV

    for name in (MEMORY_DIR_ENV, MEMORY_ADDRESS_ENV):
        assert "set by the launcher or hpc_train" in (refused_env_name(name) or "")
