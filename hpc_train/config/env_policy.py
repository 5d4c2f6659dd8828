"""Which environment variables a job may set, and which values look like credentials.

The job's ``[env]`` is exported by every rendered script and submitit's setup lines, before the shell, the
dynamic loader, Python and srun read their own variables. A config copied from someone else could therefore
run code (``BASH_ENV``, ``LD_PRELOAD``, ``PYTHONSTARTUP``) or change the job's resources behind the plan's back
(``SBATCH_*``, ``SRUN_*``). Those names are refused, with the reason; credentials are refused by name and by
the shape of known tokens (:mod:`hpc_train.config.secrets`), since the environment is written into plans and
scripts.
"""

from __future__ import annotations

import re

from hpc_train.config.secrets import secret_reason as rule_secret_reason

__all__ = ["BOOTSTRAP_ENV", "refused_env_name", "secret_reason"]

# Variables the bootstrap owns: a value from [env] would point ranks at the wrong rendezvous or rank.
BOOTSTRAP_ENV = frozenset({"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                           "MASTER_PORT", "GROUP_RANK", "CROSS_RANK", "CROSS_SIZE", "HPC_TRAIN_RUN_DIR",
                           "SLURM_EXPORT_ENV", "SUBMITIT_PREEMPT_SIGNAL", "HPC_TRAIN_SHRUNK_NODES",
                           "HPC_TRAIN_CONTROL", "HPC_TRAIN_CONTROL_TOKEN",  # the agent's coordinator
                           "HPC_TRAIN_ERROR_LOG", "HPC_TRAIN_IN_PLACE", "HPC_TRAIN_IN_PLACE_LEFT",  # set by the agent
                           "HPC_TRAIN_MEMORY_DIR", "HPC_TRAIN_MEMORY_ADDRESS",  # the agent's memory tier
                           "HPC_TRAIN_REJOIN"})  # a warm restart's channel (rank/agent/rejoin.py)
_SHELL = frozenset({"BASH_ENV", "ENV", "SHELLOPTS", "BASHOPTS", "PS4", "PROMPT_COMMAND", "IFS", "CDPATH",
                    "GLOBIGNORE", "PATH", "HOME", "SHELL", "ZDOTDIR", "EXECIGNORE", "BASH_XTRACEFD"})
_LOADER = frozenset({"GLIBC_TUNABLES", "GCONV_PATH", "LOCPATH", "NLSPATH", "HOSTALIASES", "MALLOC_CONF"})
_LOADER_PREFIXES = ("LD_", "DYLD_", "MALLOC_")
_INTERPRETERS = frozenset({"PERL5OPT", "PERL5LIB", "PERLLIB", "RUBYOPT", "RUBYLIB", "NODE_OPTIONS"})
_PYTHON_ALLOWED = frozenset({"PYTHONUNBUFFERED"})
# Open MPI / PMIx / PRRTE parameters that name a program to run or a folder to load components from.
_MPI_PREFIXES = ("OMPI_MCA_", "OPAL_")
_RUNTIME_PREFIXES = ("PMIX_MCA_", "PRTE_MCA_")  # the PMIx server and PRRTE launcher: none of them is a job's
_MPI_LOADING = re.compile(r"PATH|AGENT|PLM|LAUNCH|EXEC|PREFIX|COMPONENT|PARAM_FILE|ENV_LIST", re.IGNORECASE)
_NCCL_PLUGIN = re.compile(r"NCCL_(NET|TUNER|PROFILER|ENV)_PLUGIN|NCCL_.*PLUGIN", re.IGNORECASE)

def refused_env_name(name: str) -> str | None:
    """Why ``name`` may not be set from a job's ``[env]`` (or passed by ``forward_env``); None when it may."""
    upper = name.upper()
    if upper in BOOTSTRAP_ENV or upper.startswith("TORCHELASTIC_"):
        return "is set by the launcher or hpc_train on every rank (the rendezvous and rank come from the job)"
    if upper in _SHELL or upper.startswith("BASH_FUNC_"):
        return "changes how the job's shell starts or finds programs (it could run code before hpc_train)"
    if upper.startswith(_LOADER_PREFIXES) or upper in _LOADER:
        return "changes what the dynamic loader or the C library does in every process (it could run code there)"
    if upper.startswith("PYTHON") and upper not in _PYTHON_ALLOWED:
        return "changes how Python starts (imports, startup files, home); put code on sys.path with job.program"
    if upper in _INTERPRETERS:
        return "changes how another interpreter starts (it could run code)"
    if upper.startswith(("SLURM_", "SRUN_", "SBATCH_", "SALLOC_", "SPANK_")):
        return "changes what Slurm does behind the plan's back; set the job's resources in [job] instead"
    if upper.startswith(_RUNTIME_PREFIXES) or (upper.startswith(_MPI_PREFIXES) and _MPI_LOADING.search(upper)):
        return "makes the MPI runtime run a program or load components from a path"
    if _NCCL_PLUGIN.fullmatch(upper):
        return "makes NCCL load a shared library; a site sets its plugins in [network.nccl]"
    return None


def secret_reason(name: str, value: str) -> str | None:
    """Why ``name = value`` looks like a credential; None if not. The one rule of
    :mod:`hpc_train.config.secrets`, which the plan's other values pass too."""
    return rule_secret_reason(name, value)
