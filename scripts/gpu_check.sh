#!/usr/bin/env bash
# The prepared GPU check (benchmarks/gpu_check.py says what it runs): on a machine with one GPU it writes
# benchmarks/results/gpu-check.json. With --cpu-dry-run it runs the same steps on this CPU machine (gloo, fp32,
# tiny sizes); CI does that.
#   scripts/gpu_check.sh [--cpu-dry-run] [--out FILE] [--only STEP,...]
# On a bare GPU machine (CUDA PyTorch, no DeepSpeed, no submitit, maybe no package index): run
# scripts/gpu_wheels.sh on the CPU machine first; wheels/ then travels with the tree and is installed here.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -x .venv/bin/python ]; then
  PY=.venv/bin/python
else
  PY="${PYTHON:-python3}"
  if ! "$PY" -c "import deepspeed, submitit, rich" 2>/dev/null; then
    [ -d wheels ] || { echo "gpu_check: no DeepSpeed or submitit here and no wheels/: run scripts/gpu_wheels.sh" \
                            "on a machine with a package index first" >&2; exit 2; }
    "$PY" -m venv --system-site-packages .gpu-venv  # CUDA PyTorch stays the system's
    .gpu-venv/bin/pip install --quiet --no-index --find-links wheels deepspeed submitit rich
    PY=.gpu-venv/bin/python
  fi
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # hpc_train from this tree, installed or not
exec "$PY" benchmarks/gpu_check.py "$@"
