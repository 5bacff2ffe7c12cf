#!/usr/bin/env bash
# Set up (first run only) and run the whole test suite, plus ruff and mypy.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/bootstrap.sh
.venv/bin/ruff check src tests benchmarks
.venv/bin/ruff format --check src tests benchmarks
.venv/bin/mypy src/idlegrid
exec .venv/bin/python -m pytest "$@"
