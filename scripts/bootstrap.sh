#!/usr/bin/env bash
# Create or refresh .venv with hpc_train (editable) and everything the quick start and the tests need.
# Idempotent: it reinstalls only when setup.cfg or the constraints changed. Override the interpreter with PYTHON.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
if ! "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
    echo "bootstrap: hpc_train needs Python 3.11 or newer ($PYTHON is $("$PYTHON" -V 2>&1))" >&2
    exit 2
fi
if [ ! -x .venv/bin/python ]; then
    if ! "$PYTHON" -m venv .venv 2>/dev/null; then
        # Debian ships venv separately; install it when we may.
        if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
            apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-venv >/dev/null
            rm -rf .venv && "$PYTHON" -m venv .venv
        else
            echo "bootstrap: '$PYTHON -m venv' failed; install python3-venv" >&2
            exit 1
        fi
    fi
fi
stamp=.venv/.hpc_train-installed
want=$(cat setup.cfg pyproject.toml constraints/cpu.txt | sha256sum | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    echo "bootstrap: installing hpc_train with torch (CPU), deepspeed, mpi4py, transformers, Lightning, accelerate and test tools into .venv"
    .venv/bin/python -m pip install -q --upgrade pip setuptools wheel
    # pip writes the packages' bytecode one file after another; compileall writes the same files on every core
    # (80 s -> 65 s for the whole install on this machine's 2 cores). The bytecode must exist: PYTHONDONTWRITEBYTECODE
    # may be set, and then every process that imports torch would compile it from source again.
    .venv/bin/python -m pip install -q --no-compile -c constraints/cpu.txt \
        -e '.[train,mpi,hf,libs,plot,wandb,prometheus,nvml,dev]'
    .venv/bin/python -m compileall -q -j 0 "$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" \
        >/dev/null || true  # a file of another Python's syntax in a package (its test data) is no reason to stop
    echo "$want" > "$stamp"
fi
