#!/usr/bin/env bash
# The main job on this machine: installs what it needs, then runs the quick-start example on the local
# executor (2 ranks, gloo) with progress on screen and a run folder in ./runs/tiny-gpt. Until the trainer
# lands, the job is the distributed smoke program (one gloo group, every parallel group checked).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/bootstrap.sh
exec .venv/bin/python -m hpc_train.submit examples/tiny_gpt.toml --site local "$@"
