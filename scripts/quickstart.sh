#!/usr/bin/env bash
# The main job on this machine: installs what it needs, then trains the tiny GPT of the quick-start example
# on the local executor (2 ranks, gloo, ZeRO-2) with progress on screen and a run folder in ./runs/tiny-gpt.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/bootstrap.sh
# checkpoint.resume=false: every quick start trains from the beginning (a real run resumes by itself).
exec .venv/bin/python -m hpc_train.submit examples/tiny_gpt.toml --site local --set checkpoint.resume=false "$@"
