#!/usr/bin/env bash
# Run every test: lint, then pytest. Installs what it needs first (scripts/bootstrap.sh).
# Extra arguments go to pytest, e.g. scripts/test.sh -k render
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/bootstrap.sh
.venv/bin/ruff check hpc_train tests benchmarks
.venv/bin/python -m pytest -q -p no:cacheprovider "$@"
