#!/usr/bin/env bash
# Run on the CPU machine before a GPU check: the wheels scripts/gpu_check.sh installs on a bare GPU machine that
# has CUDA PyTorch but neither DeepSpeed nor submitit (it may have no package index at all). DeepSpeed builds as
# a pure-Python wheel with its ops left to JIT (DS_BUILD_OPS=0). They go into wheels/ (ignored by git), which
# travels with the tree.
#   scripts/gpu_wheels.sh [PYTHON_VERSION]   (default: this machine's, like 3.11)
set -euo pipefail
cd "$(dirname "$0")/.."
PIP=".venv/bin/pip"
[ -x "$PIP" ] || { scripts/bootstrap.sh >/dev/null; }
version="${1:-$(.venv/bin/python -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')}"
rm -rf wheels && mkdir -p wheels
# Pure-Python wheels built here, pinned like the CPU install.
DS_BUILD_OPS=0 "$PIP" wheel --quiet --no-deps -c constraints/cpu.txt -w wheels deepspeed submitit rich \
  markdown-it-py mdurl pygments cloudpickle hjson py-cpuinfo einops ninja msgpack psutil pydantic \
  annotated-types typing-inspection 2>&1 | grep -v "^WARNING: Location" || true
# pydantic-core, msgpack, psutil and ninja have compiled parts: binary wheels for the GPU machine's Python.
"$PIP" download --quiet --no-deps --only-binary=:all: --python-version "$version" \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
  -d wheels pydantic-core msgpack psutil ninja 2>&1 | grep -v "^WARNING: Location" || true
ls wheels
